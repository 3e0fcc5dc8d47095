"""Binary frames that carry models and updates over MQTT: encode, check, chunk, reassemble.

A frame is a 64-byte little-endian header, UTF-8 JSON metadata, zero padding to a multiple
of 16 bytes, then the raw tensor bytes (docs/protocol.md has the byte layout):

    data = encode("update", 5, "pi-07", {"params": w}, {"num_samples": 600}, table)
    frame = decode(data, Expectation(table, kinds="update", rounds=5, topic_sender="pi-07"))
    frame.buffers["params"]          # float32 view into `data`, no copy (read-only)

    for chunk in split(data, 128 * 1024):               # AWS IoT's payload limit
        publish(topic, chunk)
    ...
    frame = reassembler.add(payload, expect)            # None until the last chunk arrives

Every received frame is checked before anything reads its tensors; each failure raises
FrameError whose `reason` names what is wrong and `code` names the check (for counters).
Metadata is parsed with json.loads and validated field by field: never pickle, never eval.

The package is cut along the order in which a frame is read, each module importing only the
ones above it in this list:

    header      the format's vocabulary and limits, FrameError and EncodeError, the CRC, the
                64-byte header and the checks that need only the bytes (read_header, the
                body CRC, verify): docs/protocol.md sections 2 and 6, checks 1-8 and 13
    checks      what a receiver accepts (Expectation) and the checks of a frame's fields
                against it: metadata, parties, scalars, buffer rows, scales, finite values
                (sections 3 and 6, checks 9-12, 14-16 and the finite values of 17)
    frame       encode() and decode(): the body's layout and the tensor encodings, f32, f16
                and int8 (sections 3 and 4); decode runs the checks above in their order,
                and itself the range of int8 codes (the rest of check 17)
    reassembly  split() and the Reassembler with its memory and flooding limits (section 5,
                docs/limits.md)

The checks sit apart from the encoder and decoder because both directions share them
(encode refuses the scalars and non-finite tensors that decode would reject), and the
header sits below everything because every path, a chunk's included, starts by reading it.
Callers use the names below, as `wire.encode` or `from edgefl.transport.wire import
FrameError`; the modules' underscored helpers are theirs.
"""
from __future__ import annotations

from .checks import Expectation
from .frame import (SIGNATURE_SCALAR, Frame, content_digest, decode, encode, frame_digest,
                    new_message_id, peek_scalars)
from .header import (ALIGN, BLOB_KINDS, COMPRESSIONS, CRC32_IMPL, DTYPES, FLAG_CHUNK,
                     HEADER_SIZE, ITEMSIZE, KINDS, KNOWN_FLAGS, MAGIC, MAX_JSON_DEPTH,
                     MAX_META_BYTES, MAX_NAME_CHARS, TENSOR_KINDS, VERSION, EncodeError,
                     FrameError, Header, read_header, verify)
from .reassembly import Reassembler, split

__all__ = [
    "ALIGN", "BLOB_KINDS", "COMPRESSIONS", "CRC32_IMPL", "DTYPES", "FLAG_CHUNK", "HEADER_SIZE",
    "ITEMSIZE", "KINDS", "KNOWN_FLAGS", "MAGIC", "MAX_JSON_DEPTH", "MAX_META_BYTES",
    "MAX_NAME_CHARS", "TENSOR_KINDS", "VERSION", "EncodeError", "Expectation", "Frame",
    "FrameError", "Header", "Reassembler", "decode", "encode", "new_message_id", "read_header",
    "split", "verify", "SIGNATURE_SCALAR", "content_digest", "frame_digest", "peek_scalars",
]
