"""A whole frame in and out: encode() lays it out, decode() checks it and gives its tensors.

The body after the header (docs/protocol.md sections 3 and 4): the metadata written as
compact JSON, the payload's buffers each 16-byte aligned, and the tensor encodings: f32 as
it is, f16, and int8 with one scale per layer, both ways through the C kernels; blob kinds
(onnx) carry bytes as they are. decode() runs the checks of header.py and checks.py in the
order of section 6 and returns a Frame whose f32 and blob buffers are views into the
received bytes, without a copy. _assemble() is also how split() writes each chunk.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import types
from collections.abc import Mapping
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import kernels
from ...errors import KernelError
from ...params import LayerTable
from ..topics import TopicError, validate_id
from .checks import (Expectation, _check_buffer_meta, _check_header_expectation,
                     _check_parties, _json_value, _layer_at, _meta_keys, _nonfinite_reason,
                     _parse_meta)
from .header import (ALIGN, BLOB_KINDS, COMPRESSIONS, KINDS, MAX_META_BYTES, MAX_NAME_CHARS,
                     EncodeError, FrameError, Header, _align, _as_view, _check_body_crc,
                     _crc32, _pack_header, read_header)

_F16_OVERFLOW = 65520.0      # float32 values at or beyond this round to float16 infinity


# ---------------------------------------------------------------------------------------
# Frame and decode
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Frame:
    """A decoded, checked frame. `buffers` are read-only: float32 arrays of the table's size
    (views into the received bytes when dtype is f32, decompressed copies for f16/i8), or
    uint8 arrays (views) for blob kinds such as onnx."""

    kind: str
    round: int
    sender: str
    recipient: str | None
    dtype: str
    buffers: Mapping[str, np.ndarray]
    scalars: Mapping[str, Any]
    table_hash: int
    message_id: int
    nbytes: int
    # what content_sha256 reads: the buffer rows of the metadata and the payload's bytes
    # as received (a view); a signature covers these, so a receiver checks the bytes it got
    rows: tuple = dataclasses.field(default=(), repr=False, compare=False)
    payload: Any = dataclasses.field(default=None, repr=False, compare=False)
    # (content_core, digest) hashed by the Reassembler while the chunks arrived (its
    # `digests`); used only when the core is this frame's own
    digest_hint: Any = dataclasses.field(default=None, repr=False, compare=False)

    def content_sha256(self) -> str:
        """The sha256 a frame signature covers (content_digest), of this frame as received."""
        core = content_core(self.kind, self.round, self.sender, self.recipient, self.dtype,
                            self.table_hash, self.message_id, list(self.rows),
                            dict(self.scalars))
        if self.digest_hint is not None and self.digest_hint[0] == core:
            return self.digest_hint[1]
        return frame_digest(core, hashlib.sha256(self.payload).hexdigest())

    @property
    def compression(self) -> str:
        return {v: k for k, v in COMPRESSIONS.items()}.get(self.dtype, "none")

    def __repr__(self) -> str:
        bufs = ", ".join(f"{k}[{v.size}]" for k, v in self.buffers.items())
        to = f" to {self.recipient!r}" if self.recipient else ""
        return (f"Frame({self.kind} round {self.round} from {self.sender!r}{to}, {self.dtype}, "
                f"{self.nbytes} bytes, buffers {bufs or 'none'}, scalars {dict(self.scalars)})")


def decode(data, expect: Expectation) -> Frame:
    """Check a whole frame against `expect` and return it; FrameError names the first failure.

    Order: header (size, magic, version, header CRC, known values, sizes), the expectation's
    header fields (kind, round, table hash, dtype), body CRC, metadata (JSON, keys, sender,
    recipient, buffers, scalars), tensor values (finite; int8 codes in [-127, 127])."""
    mv = _as_view(data)
    h = read_header(mv)
    if h.is_chunk:
        raise FrameError("chunk", f"{h.describe()}: a chunk, not a whole frame; pass chunks to "
                                  "Reassembler.add")
    _check_header_expectation(h, expect)
    _check_body_crc(mv, h)
    return _decode_body(data, mv, h, expect)


def peek_scalars(data) -> dict:
    """The scalars of a whole frame, read before the receiver knows what to expect of it:
    after the checks that need no Expectation (header, body CRC, metadata JSON), without
    validating the rest; decode() still checks the whole frame. For a scalar that says what
    to expect (a client's task carried in its copy of the model: roles.client). FrameError
    names the first failure; a chunk has no scalars to read."""
    mv = _as_view(data)
    h = read_header(mv)
    if h.is_chunk:
        raise FrameError("chunk", f"{h.describe()}: a chunk, not a whole frame")
    _check_body_crc(mv, h)
    scalars = _parse_meta(mv, h).get("scalars")
    if not isinstance(scalars, dict):
        raise FrameError("metadata", f"{h.describe()}: 'scalars' must be an object")
    return scalars


def _decode_body(data, mv: memoryview, h: Header, expect: Expectation) -> Frame:
    meta = _parse_meta(mv, h)
    _meta_keys(meta, ("sender", "buffers", "scalars"),
               ("recipient",) if h.kind == "client_model" else (), h)
    sender, recipient = _check_parties(meta, h, expect)
    if not isinstance(meta["scalars"], dict):
        raise FrameError("metadata", f"{h.describe()}: 'scalars' must be an object")

    def scalar_error(msg):
        return FrameError("metadata", f"{h.describe()}: {msg}")
    scalars = _json_value(meta["scalars"], "scalars", err=scalar_error)
    table = expect.table
    specs = _check_buffer_meta(meta, h, table)

    base = data if isinstance(data, (bytes, bytearray)) else mv
    start = h.data_offset
    buffers = {}
    for s in specs:
        at = start + s.offset
        if h.dtype == "f32":
            arr = np.frombuffer(base, dtype=np.float32, count=s.size, offset=at)
        elif h.dtype == "f16":
            arr = np.empty(s.size, dtype=np.float32)
            kernels.f16_to_f32(arr, np.frombuffer(base, dtype=np.uint16, count=s.size, offset=at))
        elif h.dtype == "i8":
            q = np.frombuffer(base, dtype=np.int8, count=s.size, offset=at)
            if q.size and int(q.min()) < -127:
                i = int(np.argmin(q))
                raise FrameError("int8_range", f"{h.describe()}: buffer {s.name!r} holds int8 "
                                               f"code -128 at index {i}{_layer_at(table, i)}; "
                                               "codes are symmetric, -127..127")
            arr = np.empty(s.size, dtype=np.float32)
            with np.errstate(over="ignore"):     # a huge scale: the finite check names it
                kernels.i8_to_f32(arr, q, s.scales, table.segment_offsets())
        else:
            arr = np.frombuffer(base, dtype=np.uint8, count=s.size, offset=at)
        if h.dtype != "bytes":
            reason = _nonfinite_reason(arr, s.name, table)
            if reason:
                raise FrameError("non_finite", f"{h.describe()} from {sender!r}: {reason}")
        arr.flags.writeable = False
        buffers[s.name] = arr
    return Frame(h.kind, h.round, sender, recipient, h.dtype, types.MappingProxyType(buffers),
                 types.MappingProxyType(scalars), h.table_hash, h.message_id, len(mv),
                 tuple(meta["buffers"]), mv[start:start + h.payload_len])


# ---------------------------------------------------------------------------------------
# encode
# ---------------------------------------------------------------------------------------

_META_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _dumps(meta: dict) -> bytes:
    return _META_ENCODER.encode(meta).encode("utf-8")


SIGNATURE_SCALAR = "sig"       # the scalar a signed frame carries its signature in
_HEX64 = re.compile(r"[0-9a-f]{64}")


def content_digest(kind: str, round: int, sender: str, recipient: str | None, dtype: str,
                   table_hash: int, message_id: int, rows: list, scalars: Mapping,
                   pieces: list, payload_sha256: str | None = None) -> str:
    """sha256 (hex) of what a frame signature covers: the header's fields, the metadata
    (sender, recipient, buffer rows with their int8 scales, scalars but the signature) as
    canonical JSON, a newline, then the sha256 (hex) of the payload bytes as they travel
    (f32, f16 or int8 codes, blobs) (frame_digest). The sender hashes the pieces it encodes,
    the receiver the payload it received: one pass over the bytes, no copy (a Reassembler
    with `digests` hashes a chunked frame's payload while its chunks arrive). The payload's
    own sha256 is what copies of one model to several recipients share (their cores
    differ), and of a model of one f32 buffer it is checkpoint.model_sha256 of its
    parameters: `payload_sha256`, when given, is taken for the pieces' hash instead of
    hashing them (the caller vouches for it; a wrong one fails every receiver's check)."""
    if payload_sha256 is None:
        h = hashlib.sha256()
        for piece in pieces:
            h.update(piece)
        payload_sha256 = h.hexdigest()
    return frame_digest(content_core(kind, round, sender, recipient, dtype, table_hash,
                                     message_id, rows, scalars), payload_sha256)


def frame_digest(core: bytes, payload_sha256: str) -> str:
    """content_digest from its two parts: sha256 of the core JSON, a newline, and the
    payload's sha256 as 64 lowercase hex digits."""
    h = hashlib.sha256(core)
    h.update(b"\n")
    h.update(payload_sha256.encode("ascii"))
    return h.hexdigest()


def content_core(kind: str, round: int, sender: str, recipient: str | None, dtype: str,
                 table_hash: int, message_id: int, rows: list, scalars: Mapping) -> bytes:
    """The canonical JSON that content_digest hashes before the payload bytes."""
    core = {"kind": kind, "round": int(round), "sender": sender, "recipient": recipient,
            "dtype": dtype, "table_hash": int(table_hash), "message_id": f"{message_id:016x}",
            "buffers": rows,
            "scalars": {k: v for k, v in scalars.items() if k != SIGNATURE_SCALAR}}
    return json.dumps(core, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def _assemble(kind: str, dtype: str, flags: int, round: int, chunk_index: int, chunk_count: int,
              table_hash: int, message_id: int, meta: bytes, pieces: list) -> bytes:
    """header + meta + zero padding + pieces (the payload, already laid out), CRC computed."""
    meta_pad = bytes(_align(len(meta)) - len(meta))
    crc = _crc32(meta_pad, _crc32(meta))
    payload_len = 0
    for p in pieces:
        crc = _crc32(p, crc)
        payload_len += memoryview(p).nbytes
    header = _pack_header(kind, dtype, flags, round, chunk_index, chunk_count, len(meta),
                          payload_len, table_hash, message_id, crc)
    return b"".join([header, meta, meta_pad, *pieces])


def new_message_id() -> int:
    """A random 64-bit message id (groups the chunks of one message)."""
    return int.from_bytes(os.urandom(8), "little")


def _check_u(value, bits: int, what: str) -> int:
    if isinstance(value, (bool, float)) or not isinstance(value, (int, np.integer)) \
            or not 0 <= int(value) < 2 ** bits:
        raise EncodeError(f"{what}: {value!r} must be an integer in [0, 2**{bits})")
    return int(value)


def _blob_view(name: str, value) -> memoryview:
    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or not value.flags.c_contiguous:
            raise EncodeError(f"buffer {name!r}: a blob must be bytes-like (bytes, bytearray, "
                              f"memoryview or a contiguous uint8 array), got a {value.dtype} "
                              "array")
        return memoryview(value.reshape(-1))
    if isinstance(value, (bytes, bytearray, memoryview)):
        mv = memoryview(value)
        if not mv.c_contiguous:
            raise EncodeError(f"buffer {name!r}: memoryview is not contiguous")
        return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv
    raise EncodeError(f"buffer {name!r}: a blob must be bytes-like, got {type(value).__name__}")


def encode(kind: str, round: int, sender: str, buffers: Mapping[str, Any],
           scalars: Mapping[str, Any] | None = None, table: LayerTable | None = None,
           compression: str = "none", *, recipient: str | None = None,
           message_id: int | None = None, sign=None,
           payload_sha256: str | None = None) -> bytes:
    """One whole frame (chunk 0 of 1). Tensor kinds (model, client_model, update) take float32
    buffers of the table's size, all finite, sent as f32 ("none"), f16 or int8 with one scale
    per layer; blob kinds (onnx) take bytes-like buffers, compression "none". client_model
    frames name their `recipient`. EncodeError names anything refused.
    sign(digest, kind, round, message_id) -> dict: when given, its result is carried as the
    scalar "sig" (edgefl.transport.signing makes it); digest is content_digest's.
    payload_sha256: the sha256 (hex) of the payload this call lays out, when the caller has
    it already (content_digest; only with `sign`): the payload is then not hashed here."""
    if kind not in KINDS:
        raise EncodeError(f"kind {kind!r}; valid: {sorted(KINDS)}")
    round = _check_u(round, 32, "round")
    try:
        validate_id(sender, "sender")
        if kind == "client_model":
            validate_id(recipient, "recipient (client_model frames name their client)")
    except TopicError as exc:
        raise EncodeError(str(exc)) from None
    if kind != "client_model" and recipient is not None:
        raise EncodeError(f"recipient: only client_model frames have one ({kind} frame)")
    if compression not in COMPRESSIONS:
        raise EncodeError(f"compression {compression!r}; valid: {sorted(COMPRESSIONS)}")
    message_id = new_message_id() if message_id is None else _check_u(message_id, 64,
                                                                       "message_id")
    if not isinstance(buffers, Mapping):
        raise EncodeError(f"buffers: need a mapping name -> array, got {type(buffers).__name__}")
    blob = kind in BLOB_KINDS
    if blob:
        if compression != "none":
            raise EncodeError(f"compression {compression!r}: {kind} frames carry bytes as they are")
        dtype = "bytes"
    else:
        dtype = COMPRESSIONS[compression]
        if not isinstance(table, LayerTable):
            raise EncodeError(f"table: a {kind} frame needs the model's LayerTable, got "
                              f"{type(table).__name__}")
    if table is not None and not isinstance(table, LayerTable):
        raise EncodeError(f"table: need a LayerTable or None, got {type(table).__name__}")

    rows, pieces, offset = [], [], 0
    for name, value in buffers.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS \
                or any(ord(c) < 0x20 for c in name):
            raise EncodeError(f"buffer name {name!r}: need 1..{MAX_NAME_CHARS} printable "
                              "characters")
        if offset % ALIGN:                       # every buffer starts 16-byte aligned
            pieces.append(bytes(_align(offset) - offset))
            offset = _align(offset)
        row = {"name": name, "offset": offset}
        if blob:
            data = _blob_view(name, value)
            row["size"] = data.nbytes
        else:
            try:
                x = table.check(value, f"buffer {name!r}")
            except KernelError as exc:
                raise EncodeError(str(exc)) from None
            reason = _nonfinite_reason(x, name, table)
            if reason:
                raise EncodeError(f"{kind} round {round}: {reason}; refusing to send it")
            row["size"] = int(x.size)
            data = _encode_tensor(x, name, dtype, table, row)
        pieces.append(data)
        offset += data.nbytes
        rows.append(row)
    meta = {"sender": sender}
    if recipient is not None:
        meta["recipient"] = recipient
    meta["buffers"] = rows
    meta["scalars"] = _json_value(dict(scalars or {}), "scalars")
    table_hash = table.hash64 if table is not None else 0
    if payload_sha256 is not None and (sign is None or not isinstance(payload_sha256, str)
                                       or not _HEX64.fullmatch(payload_sha256)):
        raise EncodeError(f"payload_sha256 {payload_sha256!r}: need 64 lowercase hex digits, "
                          "and only with sign")
    if sign is not None:
        digest = content_digest(kind, round, sender, recipient, dtype, table_hash, message_id,
                                rows, meta["scalars"], pieces, payload_sha256)
        meta["scalars"][SIGNATURE_SCALAR] = _json_value(sign(digest, kind, round, message_id),
                                                        "scalars.sig")
    meta_bytes = _dumps(meta)
    if len(meta_bytes) > MAX_META_BYTES:
        raise EncodeError(f"metadata is {len(meta_bytes)} bytes, the limit is {MAX_META_BYTES}")
    return _assemble(kind, dtype, 0, round, 0, 1, table_hash, message_id, meta_bytes, pieces)


def _encode_tensor(x: np.ndarray, name: str, dtype: str, table: LayerTable, row: dict):
    if dtype == "f32":
        return memoryview(x).cast("B")
    if dtype == "f16":
        peak = max(float(x.max()), -float(x.min())) if x.size else 0.0
        if peak >= _F16_OVERFLOW:
            raise EncodeError(f"buffer {name!r}: |value| reaches {peak:.6g}, beyond float16's "
                              "range (65504); send it with compression 'none' or 'int8'")
        h = np.empty(x.size, dtype=np.uint16)
        kernels.f32_to_f16(h, x)
        return memoryview(h).cast("B")
    q = np.empty(x.size, dtype=np.int8)
    scales = np.empty(len(table), dtype=np.float32)
    kernels.f32_to_i8(q, scales, x, table.segment_offsets())
    row["scales"] = [float(s) for s in scales]   # exact: a float32 widened to a double
    return memoryview(q).cast("B")
