"""Wire frames, chunking, reassembly and topics (edgefl.transport; docs/protocol.md).

Frames that the encoder would never write are built here by hand from the layout in
docs/protocol.md (struct + zlib, no edgefl code), so these tests also pin the documented
byte layout: a second implementation written from the document produces what they build.
"""
import collections
import json
import random
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from edgefl import kernels
from edgefl.params import LayerTable
from edgefl.transport import topics as tp
from edgefl.transport import wire
from edgefl.transport.topics import TOPIC_TABLE, TopicError, Topics, validate_id
from edgefl.transport.wire import EncodeError, Expectation, FrameError

TABLE = LayerTable.from_shapes([("fc1.weight", (5, 7)), ("fc1.bias", (5,)),
                                ("fc2.weight", (3, 5)), ("fc2.bias", (3,))])   # 58 values
OTHER = LayerTable.from_shapes([("fc1.weight", (7, 5)), ("fc1.bias", (5,)),
                                ("fc2.weight", (3, 5)), ("fc2.bias", (3,))])   # same size
KB128 = 128 * 1024

# the documented header: bytes 0..59, then the CRC32 of those 60 bytes at 60..63
HEAD = struct.Struct("<4sBBBBIIIIQQQI8x")
FIELDS = ("magic", "version", "kind", "dtype", "flags", "round", "chunk_index", "chunk_count",
          "meta_len", "payload_len", "table_hash", "message_id", "crc")
OFFSETS = {"magic": 0, "version": 4, "kind": 5, "dtype": 6, "flags": 7, "round": 8,
           "chunk_index": 12, "chunk_count": 16, "meta_len": 20, "payload_len": 24,
           "table_hash": 32, "message_id": 40, "crc": 48, "reserved": 52, "header_crc": 60}


def params(table=TABLE, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(table.size) * scale).astype(np.float32)


def expect_update(**kw):
    kw.setdefault("kinds", "update")
    kw.setdefault("rounds", 5)
    kw.setdefault("topic_sender", "pi-07")
    return Expectation(TABLE, **kw)


def an_update(compression="none", **kw):
    buffers = kw.pop("buffers", None) or {"params": params()}
    return wire.encode("update", 5, "pi-07", buffers, {"num_samples": 600, "train_loss": 0.25},
                       TABLE, compression, **kw)


# --------------------------------------------------------------- hand-built frames (the doc)

def header_fields(data) -> dict:
    return dict(zip(FIELDS, HEAD.unpack_from(data, 0)))


def seal_header(fields: dict, reserved=bytes(8)) -> bytes:
    head = HEAD.pack(*(fields[f] for f in FIELDS))[:52] + reserved
    return head + struct.pack("<I", zlib.crc32(head))


def build(meta, payload=b"", *, kind=3, dtype=1, flags=0, round=5, chunk_index=0,
          chunk_count=1, table_hash=None, message_id=42) -> bytes:
    """A frame laid out as docs/protocol.md says: header, metadata, zero pad to 16, payload."""
    meta_b = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    body = meta_b + bytes(-len(meta_b) % 16) + payload
    fields = {"magic": b"EDFL", "version": 1, "kind": kind, "dtype": dtype, "flags": flags,
              "round": round, "chunk_index": chunk_index, "chunk_count": chunk_count,
              "meta_len": len(meta_b), "payload_len": len(payload),
              "table_hash": TABLE.hash64 if table_hash is None else table_hash,
              "message_id": message_id, "crc": zlib.crc32(body)}
    return seal_header(fields) + body


def reheader(data: bytes, reserved=bytes(8), **changes) -> bytes:
    """The frame with header fields changed and the header CRC made valid again."""
    fields = header_fields(data)
    fields.update(changes)
    return seal_header(fields, reserved) + data[64:]


def reseal(data: bytes) -> bytes:
    """Body CRC and header CRC recomputed: what a buggy (not a corrupting) writer sends."""
    return reheader(data, reserved=bytes(data[52:60]), crc=zlib.crc32(data[64:]))


def with_meta(data: bytes, edit) -> bytes:
    """The frame with its metadata replaced by edit(meta dict) (a dict or raw bytes)."""
    h = header_fields(data)
    meta = json.loads(data[64:64 + h["meta_len"]])
    new = edit(meta)
    start = 64 + -(-h["meta_len"] // 16) * 16
    return build(new if new is not None else meta, data[start:], kind=h["kind"],
                 dtype=h["dtype"], flags=h["flags"], round=h["round"],
                 chunk_index=h["chunk_index"], chunk_count=h["chunk_count"],
                 table_hash=h["table_hash"], message_id=h["message_id"])


def reject(data, expect, code, *fragments):
    with pytest.raises(FrameError) as info:
        wire.decode(data, expect)
    assert info.value.code == code, info.value.reason
    for fragment in fragments:
        assert fragment in info.value.reason, info.value.reason
    return info.value.reason


# --------------------------------------------------------------- round trips

@pytest.mark.parametrize("kind", ["model", "client_model", "update"])
def test_f32_round_trip_is_exact_and_zero_copy(kind):
    w, m = params(seed=1), params(seed=2)
    recipient = "pi-03" if kind == "client_model" else None
    data = wire.encode(kind, 9, "aggregator", {"params": w, "momentum": m},
                       {"num_samples": 12, "loss": 0.5, "fused": True, "tau": [3, 4],
                        "note": None}, TABLE, recipient=recipient, message_id=77)
    assert isinstance(data, bytes)
    frame = wire.decode(data, Expectation(TABLE, kinds=kind, rounds=9))
    assert (frame.kind, frame.round, frame.sender, frame.recipient) == \
        (kind, 9, "aggregator", recipient)
    assert (frame.dtype, frame.compression, frame.message_id, frame.nbytes) == \
        ("f32", "none", 77, len(data))
    assert frame.table_hash == TABLE.hash64
    assert dict(frame.scalars) == {"num_samples": 12, "loss": 0.5, "fused": True,
                                   "tau": [3, 4], "note": None}
    assert list(frame.buffers) == ["params", "momentum"]
    raw = np.frombuffer(data, np.uint8)
    for name, src in (("params", w), ("momentum", m)):
        got = frame.buffers[name]
        assert got.dtype == np.float32 and got.shape == (TABLE.size,)
        assert np.array_equal(got, src)
        assert np.shares_memory(got, raw), f"{name} was copied"
        assert (got.ctypes.data - raw.ctypes.data) % 16 == 0   # 16-byte aligned in the frame
        assert not got.flags.writeable
        with pytest.raises(ValueError):
            got[0] = 1.0


def test_zero_copy_for_bytearray_and_memoryview_input():
    w = params()
    data = bytearray(an_update(buffers={"params": w}))
    frame = wire.decode(data, expect_update())
    assert np.shares_memory(frame.buffers["params"], np.frombuffer(data, np.uint8))
    assert not frame.buffers["params"].flags.writeable
    frame = wire.decode(memoryview(bytes(data)), expect_update())
    assert np.array_equal(frame.buffers["params"], w)


@pytest.mark.parametrize("kind", ["model", "client_model", "update"])
def test_f16_round_trip_within_half_precision(kind):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal(TABLE.size) * 100).astype(np.float32)
    w[:5] = [65504.0, -65504.0, 1e-6, -3e-8, 0.0]   # range ends and subnormal halves
    recipient = "pi-03" if kind == "client_model" else None
    data = wire.encode(kind, 1, "aggregator", {"params": w}, None, TABLE, "f16",
                       recipient=recipient)
    assert len(data) < 64 + 200 + TABLE.size * 2 + 16
    frame = wire.decode(data, Expectation(TABLE))
    got = frame.buffers["params"]
    assert frame.dtype == "f16" and frame.compression == "f16" and got.dtype == np.float32
    # round to nearest: relative error <= 2^-11 for normal halves, <= 2^-25 absolute below
    bound = np.maximum(np.abs(w) * 2.0 ** -11, 2.0 ** -25)
    assert np.all(np.abs(got.astype(np.float64) - w) <= bound)
    assert np.array_equal(got, w.astype(np.float16).astype(np.float32))
    assert not np.shares_memory(got, np.frombuffer(data, np.uint8))
    assert not got.flags.writeable


@pytest.mark.parametrize("kind", ["model", "client_model", "update"])
def test_int8_round_trip_within_half_a_step_per_layer(kind):
    w = params(seed=4)
    w[TABLE["fc2.bias"].offset:] *= 1000            # layers with very different ranges
    recipient = "pi-03" if kind == "client_model" else None
    data = wire.encode(kind, 2, "aggregator", {"params": w}, {}, TABLE, "int8",
                       recipient=recipient)
    frame = wire.decode(data, Expectation(TABLE, rounds=range(1, 4)))
    got = frame.buffers["params"]
    assert frame.dtype == "i8" and frame.compression == "int8"
    seg = TABLE.segment_offsets()
    for e in TABLE.entries:
        x, y = w[e.offset:e.offset + e.size], got[e.offset:e.offset + e.size]
        step = np.abs(x).max() / 127
        assert np.all(np.abs(y.astype(np.float64) - x) <= 0.5 * step * (1 + 1e-5)), e.name
    q, scales, ref = np.empty(w.size, np.int8), np.empty(len(TABLE), np.float32), \
        np.empty_like(w)
    kernels.f32_to_i8(q, scales, w, seg)
    kernels.i8_to_f32(ref, q, scales, seg)
    assert np.array_equal(got, ref)    # exactly the codec, scales carried without loss
    meta = json.loads(data[64:64 + header_fields(data)["meta_len"]])
    assert np.array_equal(np.array(meta["buffers"][0]["scales"], np.float32), scales)


def test_buffers_of_odd_byte_length_are_padded_to_16():
    table = LayerTable.from_shapes([("w", (7,))])
    a, b = np.arange(7, dtype=np.float32), -np.arange(7, dtype=np.float32)
    for compression in ("none", "f16", "int8"):
        data = wire.encode("model", 1, "agg", {"a": a, "b": b}, None, table, compression)
        frame = wire.decode(data, Expectation(table))
        meta = json.loads(data[64:64 + header_fields(data)["meta_len"]])
        assert [r["offset"] for r in meta["buffers"]] == [0, 32 if compression == "none" else 16]
        assert np.allclose(frame.buffers["b"], b, atol=0.03)
        assert header_fields(data)["payload_len"] == meta["buffers"][1]["offset"] + \
            7 * wire.ITEMSIZE[frame.dtype]


def test_onnx_blob_round_trip():
    blob = bytes(range(256)) * 10 + b"tail"
    data = wire.encode("onnx", 3, "aggregator", {"model.onnx": blob}, {"opset": 17})
    frame = wire.decode(data, Expectation(None, kinds="onnx"))
    got = frame.buffers["model.onnx"]
    assert frame.dtype == "bytes" and got.dtype == np.uint8 and got.tobytes() == blob
    assert np.shares_memory(got, np.frombuffer(data, np.uint8))
    assert header_fields(data)["table_hash"] == 0
    # tied to a table, it must be that model's
    data = wire.encode("onnx", 3, "aggregator", {"model.onnx": blob}, None, TABLE)
    assert wire.decode(data, Expectation(TABLE, kinds="onnx")).buffers["model.onnx"].size == \
        len(blob)
    reject(data, Expectation(OTHER, kinds="onnx"), "table_hash")


def test_update_without_buffers_carries_scalars():
    data = wire.encode("update", 5, "pi-07", {}, {"num_samples": 10}, TABLE)
    frame = wire.decode(data, expect_update())
    assert dict(frame.buffers) == {} and frame.scalars["num_samples"] == 10
    assert header_fields(data)["payload_len"] == 0


def test_message_ids_are_random_unless_given():
    assert header_fields(an_update())["message_id"] != header_fields(an_update())["message_id"]
    assert header_fields(an_update(message_id=5))["message_id"] == 5


# --------------------------------------------------------------- encode refuses

def test_encode_refuses_what_it_cannot_send():
    w = params()
    bad = w.copy()
    bad[TABLE["fc2.weight"].offset + 2] = np.nan
    with pytest.raises(EncodeError, match=r"'params'.*nan.*index 42 \(layer 'fc2.weight'\)"):
        wire.encode("update", 1, "pi", {"params": bad}, None, TABLE)
    bad[0] = np.inf
    with pytest.raises(EncodeError, match="2 non-finite"):
        wire.encode("update", 1, "pi", {"params": bad}, None, TABLE)
    big = w.copy()
    big[3] = 70000.0
    with pytest.raises(EncodeError, match="beyond float16's range"):
        wire.encode("update", 1, "pi", {"params": big}, None, TABLE, "f16")
    assert wire.encode("update", 1, "pi", {"params": big}, None, TABLE, "int8")
    cases = [
        ({"buffers": {"params": w[:-1]}}, "does not match the layer table"),
        ({"buffers": {"params": w.astype(np.float64)}}, "float32"),
        ({"buffers": {"params": np.repeat(w, 2)[::2]}}, "contiguous"),
        ({"scalars": {"loss": float("nan")}}, r"scalars.loss is nan"),
        ({"scalars": {"obj": object()}}, "not a JSON value"),
        ({"scalars": {1: 2}}, "not a string"),
        ({"compression": "zstd"}, "compression 'zstd'"),
        ({"kind": "gradient"}, "kind 'gradient'"),
        ({"sender": "pi/07"}, "contains '/'"),
        ({"sender": ""}, "empty"),
        ({"round": -1}, "round"),
        ({"round": 2 ** 32}, "round"),
        ({"recipient": "pi-01"}, "only client_model"),
        ({"kind": "client_model"}, "recipient"),
        ({"table": None}, "LayerTable"),
        ({"buffers": {"": w}}, "buffer name"),
    ]
    for change, message in cases:
        kw = {"kind": "update", "round": 1, "sender": "pi", "buffers": {"params": w},
              "scalars": None, "table": TABLE, "compression": "none"}
        kw.update(change)
        with pytest.raises(EncodeError, match=message):
            wire.encode(**kw)
    with pytest.raises(EncodeError, match="carry bytes as they are"):
        wire.encode("onnx", 1, "agg", {"m": b"x"}, None, None, "f16")
    with pytest.raises(EncodeError, match="bytes-like"):
        wire.encode("onnx", 1, "agg", {"m": w}, None, None)


# --------------------------------------------------------------- validation, one per check

def test_reject_empty_truncated_and_foreign_payloads():
    data = an_update()
    reject(b"", expect_update(), "truncated", "empty payload")
    reject(b"{\"round\": 5}", expect_update(), "magic", "not an edgefl frame")
    reject(b"ED", expect_update(), "truncated", "2 bytes")
    reject(data[:40], expect_update(), "truncated", "40 bytes", "header alone is 64")
    reject(data[:-1], expect_update(), "truncated", f"frame is {len(data) - 1} bytes",
           f"header says {len(data)}")
    reject(data[:100], expect_update(), "truncated")
    reject(data + b"\0", expect_update(), "size", f"header says {len(data)}")


def test_reject_magic_and_version():
    data = bytearray(an_update())
    data[1] ^= 0x20
    reject(bytes(data), expect_update(), "magic", "bad magic b'EdFL'")
    reason = reject(reheader(an_update(), version=2), expect_update(), "version")
    assert reason == "frame version 2, this reader knows 1"


@pytest.mark.parametrize("field", [f for f in OFFSETS if f not in ("magic", "version")])
def test_any_header_byte_flip_fails_the_header_crc(field):
    data = bytearray(an_update())
    data[OFFSETS[field]] ^= 0x01
    reject(bytes(data), expect_update(), "header_crc", "header crc mismatch: stored 0x")


def test_reject_header_fields_with_a_valid_header_crc():
    """A writer that gets a field wrong but seals the header: each field's own check."""
    data = an_update()
    ex = expect_update()
    reject(reheader(data, kind=9), ex, "kind", "unknown kind 9")
    reject(reheader(data, dtype=9), ex, "dtype", "unknown dtype 9")
    reject(reheader(data, dtype=4), ex, "dtype", "update frames carry f32, f16 or i8, header "
                                                 "says dtype bytes")
    reject(reheader(data, flags=0x80), ex, "flags", "unknown flag bits 0x80")
    reject(reheader(data, flags=1), ex, "dtype", "a chunk carries dtype bytes")
    reject(reheader(data, chunk_index=1), ex, "chunk", "a whole frame has chunk 0 of 1")
    reject(reheader(data, chunk_count=3), ex, "chunk", "says 0 of 3")
    reject(reheader(data, meta_len=2 ** 21), ex, "size", "metadata length 2097152 exceeds")
    n = header_fields(data)["meta_len"]
    reject(reheader(data, meta_len=n + 64), ex, "truncated", f"frame is {len(data)} bytes")
    p = header_fields(data)["payload_len"]
    reject(reheader(data, payload_len=p + 4), ex, "truncated")
    reject(reheader(data, payload_len=p - 16), ex, "size", "header says")
    reject(reheader(data, round=4), ex, "unexpected_round", "round 4 not expected (expected 5)")
    reject(reheader(data, kind=1), ex, "unexpected_kind", "kind model not expected here")
    reject(reheader(data, table_hash=OTHER.hash64), ex, "table_hash",
           f"table hash 0x{OTHER.hash64:016x} does not match the model's 0x{TABLE.hash64:016x}")
    crc = header_fields(data)["crc"]
    reject(reheader(data, crc=crc ^ 0xFFFF), ex, "crc",
           f"crc mismatch: header 0x{crc ^ 0xFFFF:08x}, computed 0x{crc:08x}")
    reject(reheader(data, reserved=b"\0\0\0\x07\0\0\0\0"), ex, "reserved",
           "reserved header bytes 52..59 are not zero")


def test_reject_body_corruption_by_crc():
    data = an_update()
    n = header_fields(data)["meta_len"]
    for at in (64, 64 + n - 1, len(data) - 1, len(data) - 4 * TABLE.size):
        bad = bytearray(data)
        bad[at] ^= 0x40
        reject(bytes(bad), expect_update(), "crc", "crc mismatch", "metadata + padding + payload")


def test_reject_table_of_another_model():
    data = wire.encode("update", 5, "pi-07", {"params": params(OTHER)}, None, OTHER)
    reason = reject(data, expect_update(), "table_hash", "a frame for another model")
    assert TABLE.digest[:12] in reason


def test_reject_expectations_kind_round_sender_dtype():
    data = an_update()
    reject(data, expect_update(rounds={6, 7}), "unexpected_round", "(expected 6, 7)")
    reject(data, expect_update(rounds=range(6, 9)), "unexpected_round", "(expected 6..8)")
    reject(data, expect_update(kinds={"model", "client_model"}), "unexpected_kind",
           "expected client_model, model")
    reject(data, expect_update(topic_sender="pi-08"), "sender",
           "sender 'pi-07' arrived on the topic of 'pi-08'")
    reject(data, expect_update(topic_sender=None, senders={"pi-01"}), "sender",
           "sender 'pi-07' not expected")
    reject(an_update("f16"), expect_update(dtypes={"f32"}), "dtype", "dtype f16 not accepted")
    assert wire.decode(data, expect_update(rounds=None, topic_sender=None)).round == 5
    cm = wire.encode("client_model", 5, "agg", {"params": params()}, None, TABLE,
                     recipient="pi-01")
    reject(cm, Expectation(TABLE, topic_recipient="pi-02"), "recipient",
           "model for 'pi-01' arrived on the topic of 'pi-02'")
    reject(wire.split(an_update(), 200)[0], expect_update(), "chunk", "Reassembler.add")


def test_expectation_for_topic_and_its_own_checks():
    topics = Topics("fed")
    kind, node = topics.parse(topics.update("pi-07"))
    ex = Expectation.for_topic(kind, node, TABLE, rounds=5)
    assert ex.kinds == {"update"} and ex.topic_sender == "pi-07" and ex.rounds == {5}
    assert wire.decode(an_update(), ex).sender == "pi-07"
    ex = Expectation.for_topic(*topics.parse(topics.update("pi-08")), TABLE)
    reject(an_update(), ex, "sender")
    ex = Expectation.for_topic(*topics.parse(topics.client_model("pi-02")), TABLE)
    assert ex.kinds == {"client_model"} and ex.topic_recipient == "pi-02"
    with pytest.raises(ValueError, match="carries JSON"):
        Expectation.for_topic(*topics.parse(topics.status("pi-02")), TABLE)
    with pytest.raises(ValueError, match="give the model's LayerTable"):
        Expectation(None)
    with pytest.raises(ValueError, match="unknown"):
        Expectation(TABLE, kinds="gradients")
    with pytest.raises(ValueError, match="ints"):
        Expectation(TABLE, rounds={"5"})


def _json_value_reference(v, path, depth=0):
    """The scalars' check as it was written first, before its fast paths: the oracle for
    wire.checks._json_value (the same data back, or EncodeError with the same message)."""
    from collections.abc import Mapping
    import math

    from edgefl.transport.wire.header import MAX_JSON_DEPTH
    if depth > MAX_JSON_DEPTH:
        raise EncodeError(f"{path}: nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(v, np.generic):
        v = v.item()
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise EncodeError(f"{path} is {v}: JSON metadata carries finite numbers only "
                              "(send None for 'no value')")
        return float(v)
    if isinstance(v, (list, tuple)):
        return [_json_value_reference(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
    if isinstance(v, Mapping):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise EncodeError(f"{path}: key {k!r} is not a string")
            out[k] = _json_value_reference(x, f"{path}.{k}", depth + 1)
        return out
    raise EncodeError(f"{path}: {type(v).__name__} is not a JSON value (numbers, strings, "
                      "bools, None, lists, dicts)")


def test_scalars_check_gives_what_its_first_version_gave_data_and_errors():
    """wire.checks._json_value takes the exact JSON types first and spells a value's path
    only for an error: on random scalars, good and bad, it returns the same data as the
    first version of the check (kept above as the oracle), with the same types, or fails
    with the same message."""
    import types

    from edgefl.transport.wire.checks import _json_value

    class Key(str):
        pass

    rng = random.Random(7)
    leaves = [None, True, False, 0, -3, 2 ** 40, 1.5, -0.0, "x", "", np.float32(0.25),
              np.int64(7), np.bool_(True), float("nan"), float("inf"), object(), b"raw",
              {1: 2}, {Key("k"): 1}]

    def value(depth):
        roll = rng.random()
        if depth > 18 or roll < 0.4:
            return rng.choice(leaves)
        n = rng.randrange(4)
        if roll < 0.6:
            return [value(depth + 1) for _ in range(n)]
        if roll < 0.7:
            return tuple(value(depth + 1) for _ in range(n))
        items = {f"k{i}": value(depth + 1) for i in range(n)}
        return types.MappingProxyType(items) if roll < 0.75 else items

    outcomes = collections.Counter()
    for _ in range(3000):
        v = {"a": value(0)}
        try:
            want = _json_value_reference(v, "scalars")
        except EncodeError as exc:
            with pytest.raises(EncodeError) as got:
                _json_value(v, "scalars")
            assert str(got.value) == str(exc)
            outcomes["refused"] += 1
            continue
        got = _json_value(v, "scalars")
        assert json.dumps(got) == json.dumps(want)
        assert repr(got) == repr(want)                  # the same types, not only values
        outcomes["taken"] += 1
    assert outcomes["taken"] > 500 and outcomes["refused"] > 500


def test_reject_bad_metadata():
    data, ex = an_update(), expect_update()
    cases = [
        (lambda m: b"\xff\xfe{}", "metadata", "not UTF-8"),
        (lambda m: b'{"sender": "pi-07",', "metadata", "not valid JSON"),
        (lambda m: b'{"sender":"pi-07","buffers":[],"scalars":{"x":NaN}}', "metadata",
         "NaN is not a finite number"),
        (lambda m: b'{"sender":"pi-07","buffers":[],"scalars":{"x":1e999}}', "metadata",
         "overflows"),
        (lambda m: b'{"sender":"pi-07","sender":"pi-07","buffers":[],"scalars":{}}', "metadata",
         "duplicate key 'sender'"),
        (lambda m: b"[" * 100000 + b"]" * 100000, "metadata", "not valid JSON"),
        (lambda m: [m], "metadata", "must be a JSON object, got list"),
        (lambda m: {k: v for k, v in m.items() if k != "scalars"}, "metadata",
         "missing ['scalars']"),
        (lambda m: dict(m, extra=1), "metadata", "unknown ['extra']"),
        (lambda m: dict(m, scalars=[1]), "metadata", "'scalars' must be an object"),
        (lambda m: dict(m, scalars={"a": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]}), "metadata",
         "nested deeper"),
        (lambda m: dict(m, sender="pi-0#"), "sender", "contains '#'"),
        (lambda m: dict(m, sender=7), "sender", "must be a string"),
        (lambda m: dict(m, recipient="pi-01"), "metadata", "unknown ['recipient']"),
        (lambda m: dict(m, buffers={}), "metadata", "'buffers' must be a list"),
        (lambda m: dict(m, buffers=[7]), "metadata", "buffers[0] must be an object"),
        (lambda m: dict(m, buffers=[dict(m["buffers"][0], scales=[1.0])]), "metadata",
         "a f32 buffer has ['name', 'offset', 'size']"),
        (lambda m: dict(m, buffers=[dict(m["buffers"][0], name="")]), "metadata", "name ''"),
        (lambda m: dict(m, buffers=[dict(m["buffers"][0], offset=-16)]), "metadata",
         "'offset' must be an integer >= 0, got -16"),
        (lambda m: dict(m, buffers=[dict(m["buffers"][0], size=True)]), "metadata",
         "'size' must be an integer"),
        (lambda m: dict(m, buffers=[dict(m["buffers"][0], offset=4)]), "buffer",
         "offset 4 is not a multiple of 16"),
        (lambda m: dict(m, buffers=[dict(m["buffers"][0], offset=16)]), "buffer",
         "spans payload bytes [16, 248) beyond the payload's 232"),
        (lambda m: dict(m, buffers=[dict(m["buffers"][0], size=10)]), "buffer",
         "has 10 values, the model's layer table has 58"),
    ]
    for edit, code, fragment in cases:
        reject(with_meta(data, edit), ex, code, fragment)
    two = an_update(buffers={"params": params(), "momentum": params(seed=1)})
    assert [b["offset"] for b in json.loads(two[64:64 + header_fields(two)["meta_len"]])
            ["buffers"]] == [0, 240]
    for edit, fragment in [
        (lambda m: dict(m, buffers=[m["buffers"][0], dict(m["buffers"][1], offset=224)]),
         "buffer 'momentum' at payload offset 224 overlaps 'params' (ends at 232)"),
        (lambda m: dict(m, buffers=[m["buffers"][1], m["buffers"][0]]),
         "buffer 'params' at payload offset 0 overlaps 'momentum' (ends at 472)"),
        (lambda m: dict(m, buffers=[m["buffers"][0], dict(m["buffers"][1], name="params")]),
         "buffer 'params' appears twice"),
    ]:
        reject(with_meta(two, edit), ex, "buffer", fragment)


def test_reject_nonzero_padding_after_metadata():
    data = an_update()
    n = header_fields(data)["meta_len"]
    assert n % 16, "pick metadata whose length needs padding"
    bad = bytearray(data)
    bad[64 + n] = 1
    reject(reseal(bytes(bad)), expect_update(), "padding", "padding bytes")


def test_reject_non_finite_values_in_each_dtype():
    nan_at = TABLE["fc1.bias"].offset + 1
    f32 = np.frombuffer(params().tobytes(), np.float32).copy()
    f32[nan_at] = np.nan
    meta = {"sender": "pi-07", "buffers": [{"name": "params", "offset": 0, "size": TABLE.size}],
            "scalars": {}}
    reject(build(meta, f32.tobytes()), expect_update(), "non_finite",
           "from 'pi-07'", "'params' holds 1 non-finite value(s); the first, nan, at index 36 "
           "(layer 'fc1.bias')")
    h = params().astype(np.float16)
    h[3] = np.inf
    reject(build(meta, h.tobytes(), dtype=2), expect_update(), "non_finite", "inf, at index 3",
           "(layer 'fc1.weight')")


def test_reject_bad_int8_codes_and_scales():
    data = an_update("int8")
    ex = expect_update()
    fields = header_fields(data)
    start = 64 + -(-fields["meta_len"] // 16) * 16
    bad = bytearray(data)
    bad[start + 36] = 0x80                       # int8 -128
    reject(reseal(bytes(bad)), ex, "int8_range", "code -128 at index 36", "'fc1.bias'")

    def scales(values):
        return lambda m: dict(m, buffers=[dict(m["buffers"][0], scales=values)])
    reject(with_meta(data, scales([0.1, 0.1, 0.1])), ex, "scales", "needs 4 int8 scales")
    reject(with_meta(data, scales([0.1, 0.0, 0.1, 0.1])), ex, "scales",
           "scale of layer 'fc1.bias' is 0.0")
    reject(with_meta(data, scales([0.1, 0.1, -2, 0.1])), ex, "scales", "'fc2.weight' is -2")
    reject(with_meta(data, scales([0.1, 0.1, 0.1, 1e39])), ex, "scales", "is 1e+39",
           "finite in float32")
    # a legal scale whose products overflow: caught by the finite check of decoded values
    reject(with_meta(data, scales([0.1, 0.1, 0.1, 1e38])), ex, "non_finite", "inf",
           "(layer 'fc2.bias')")
    reject(with_meta(data, scales([0.1, "0.1", 0.1, 0.1])), ex, "scales", "must be numbers")


def test_crafted_frame_from_the_document_decodes():
    """A frame built only from docs/protocol.md is accepted (the layout is what we say)."""
    w = params()
    meta = {"sender": "pi-07", "buffers": [{"name": "params", "offset": 0, "size": TABLE.size}],
            "scalars": {"num_samples": 3}}
    frame = wire.decode(build(meta, w.tobytes()), expect_update())
    assert np.array_equal(frame.buffers["params"], w) and frame.scalars["num_samples"] == 3
    # and the encoder writes exactly that, byte for byte
    assert wire.encode("update", 5, "pi-07", {"params": w}, {"num_samples": 3}, TABLE,
                       message_id=42) == build(json.dumps(meta, separators=(",", ":")).encode(),
                                               w.tobytes())


def test_protocol_doc_example_is_what_the_encoder_writes():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    block = doc.split("<!-- example-frame")[1].split("```")[1]
    dumped = bytes.fromhex("".join(line[10:58] for line in block.strip().splitlines()))
    w = np.array([0.5, -1.0, 2.0, 0.25, 1.5, -0.125], np.float32)
    table = LayerTable.from_shapes([("fc.weight", (2, 2)), ("fc.bias", (2,))])
    data = wire.encode("update", 3, "pi-07", {"params": w}, {"num_samples": 32, "train_loss": 0.5},
                       table, message_id=0x0123456789ABCDEF)
    assert data == dumped
    assert f"table_hash = 0x{table.hash64:016x}" in doc
    assert zlib.crc32(b"123456789") == 0xCBF43926


def test_the_frame_crc_is_zlibs_crc32_whatever_computes_it():
    """wire computes CRC-32 with zlib-ng where it is installed; it must be the standard
    library's checksum bit for bit (docs/protocol.md), for every length and running value,
    so frames stay readable by any implementation."""
    rng = np.random.default_rng(7)
    assert wire.header._crc32(b"123456789") == 0xCBF43926
    for n in [0, 1, 15, 16, 17, 63, 64, 65, 255, 4096, 131_072 + 3, 4_000_192]:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        start = int(rng.integers(0, 2 ** 32))
        assert wire.header._crc32(data) == zlib.crc32(data), n
        assert wire.header._crc32(data, start) == zlib.crc32(data, start), n
        assert wire.header._crc32(memoryview(data)[n // 3:]) == zlib.crc32(data[n // 3:]), n
    assert wire.CRC32_IMPL in ("zlib-ng", "zlib")


# --------------------------------------------------------------- chunking and reassembly

BIG = LayerTable.from_shapes([("fc1.weight", (1500, 1000)), ("fc1.bias", (1000,)),
                              ("fc2.weight", (10, 1000)), ("fc2.bias", (10,))])  # 6 MB as f32


def chunk_total(chunk: bytes) -> int:
    return json.loads(chunk[64:64 + header_fields(chunk)["meta_len"]])["total"]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.mark.parametrize("compression", ["none", "f16", "int8"])
def test_split_at_128k_and_reassemble_shuffled_with_duplicates(compression):
    w = params(BIG, seed=5)
    data = wire.encode("update", 3, "pi-07", {"params": w}, {"num_samples": 9}, BIG,
                       compression)
    chunks = wire.split(data, KB128)
    assert len(chunks) == -(-len(data) // (KB128 - 64 - 64))
    assert all(len(c) <= KB128 for c in chunks)
    ids = set()
    for i, c in enumerate(chunks):
        h = wire.read_header(c)          # each chunk is a frame of its own, its CRC valid
        assert h.is_chunk and h.dtype == "bytes"
        assert (h.chunk_index, h.chunk_count, h.round, h.kind) == (i, len(chunks), 3, "update")
        assert zlib.crc32(c[64:]) == h.crc
        ids.add(h.message_id)
    assert ids == {header_fields(data)["message_id"]}

    ex = Expectation(BIG, kinds="update", rounds=3, topic_sender="pi-07")
    arrivals = chunks + random.Random(1).sample(chunks, 10)   # QoS 1 redeliveries
    random.Random(2).shuffle(arrivals)
    r = wire.Reassembler(timeout_s=30)
    got = [r.add(c, ex) for c in arrivals]
    frames = [f for f in got if f is not None]
    assert len(frames) == 1
    complete_at = next(i for i, f in enumerate(got) if f is not None)
    seen = set()
    for i, c in enumerate(arrivals):   # completes exactly when the last distinct chunk arrives
        seen.add(wire.read_header(c).chunk_index)
        if len(seen) == len(chunks):
            assert i == complete_at
            break
    direct = wire.decode(data, ex)
    assert np.array_equal(frames[0].buffers["params"], direct.buffers["params"])
    assert frames[0].scalars["num_samples"] == 9 and frames[0].nbytes == len(data)
    assert r.bytes_in_flight == 0 and r.pending == 0
    assert all(r.add(c, ex) is None for c in chunks[:5])     # late duplicates: ignored
    assert r.pending == 0


def test_a_repeated_chunk_index_keeps_the_first_copy():
    w = params(BIG, seed=6)
    chunks = wire.split(wire.encode("update", 3, "pi-07", {"params": w}, None, BIG), KB128)
    ex = Expectation(BIG, kinds="update", rounds=3, topic_sender="pi-07")
    r = wire.Reassembler()
    assert all(r.add(c, ex) is None for c in chunks[:-1])
    # a sealed chunk 0 with other bytes (a buggy resend): same index, so ignored
    tampered = bytearray(chunks[0])
    tampered[-100:] = bytes(100)
    assert r.add(reseal(bytes(tampered)), ex) is None
    frame = r.add(chunks[-1], ex)
    assert np.array_equal(frame.buffers["params"], w)


def test_small_frames_are_not_split_and_are_deduplicated():
    data = an_update()
    assert wire.split(data, KB128) == [data] and wire.split(data, KB128)[0] is data
    r = wire.Reassembler()
    assert r.add(data, expect_update()).sender == "pi-07"
    assert r.add(data, expect_update()) is None
    assert r.add(an_update(), expect_update()) is not None    # a new message id


def test_split_refuses_tiny_limits_and_chunks():
    data = wire.encode("model", 1, "agg", {"params": params(BIG)}, None, BIG)
    with pytest.raises(EncodeError, match="leaves no room"):
        wire.split(data, 120)
    with pytest.raises(EncodeError, match="already a chunk"):
        wire.split(wire.split(data, KB128)[0], KB128)
    with pytest.raises(EncodeError, match="not a valid frame"):
        wire.split(data[:-3], KB128)


@pytest.mark.parametrize("sender,recipient", [("agg", None), ("agg", "pi-07"),
                                              ("pi-ü\"x", None), ("b\\oard é", "klient-ß")])
def test_chunk_metadata_is_the_json_of_its_fields(sender, recipient):
    # split() writes chunk metadata from a per-frame template: it must stay byte for byte what
    # the JSON encoder writes for the same fields (non-ASCII and escaped characters included)
    meta = {"sender": sender, **({"recipient": recipient} if recipient else {}),
            "offset": 131008, "total": 4000180}
    assert wire.reassembly._chunk_meta(sender, recipient, 131008, 4000180) == \
        json.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    kind = "client_model" if recipient else "model"
    data = wire.encode(kind, 2, sender, {"params": params(BIG)}, None, BIG, recipient=recipient)
    for chunk in wire.split(data, KB128):
        h = wire.read_header(chunk)
        assert json.loads(bytes(chunk[64:64 + h.meta_len]))["sender"] == sender


def test_metadata_with_a_byte_order_mark_is_refused_as_json_loads_refuses_it():
    data = bytearray(wire.encode("update", 1, "pi-07", {"params": params(BIG)}, None, BIG))
    h = wire.read_header(bytes(data))
    meta = bytes(data[64:64 + h.meta_len])
    forged = wire.frame._assemble("update", "f32", 0, 1, 0, 1, BIG.hash64, h.message_id,
                                  "\ufeff".encode() + meta, [bytes(data[h.data_offset:])])
    with pytest.raises(FrameError, match="BOM") as err:
        wire.decode(forged, Expectation(BIG, kinds="update"))
    assert err.value.code == "metadata"


@pytest.mark.parametrize("value", [".", ".."])
def test_an_id_that_names_a_directory_itself_or_its_parent_is_refused(value):
    """Ids become path components (runs/<run id>/, a node's state directory): `.` or `..`
    there would name the runs directory itself or the state directory, and a prune of that
    "run" would remove every run's files."""
    with pytest.raises(TopicError, match=r"names a directory itself or its parent"):
        validate_id(value, "run")


def test_validated_ids_are_remembered_but_bad_ones_never_pass():
    for _ in range(3):
        assert validate_id("pi-07") == "pi-07"
        with pytest.raises(TopicError, match="topic separator"):
            validate_id("pi/07")

    class Sly(str):
        pass

    tp._VALID_IDS.clear()
    assert validate_id(Sly("pi-sly")) == "pi-sly"
    assert "pi-sly" not in tp._VALID_IDS           # a str subclass is checked, not cached
    assert "pi-07" not in tp._VALID_IDS and validate_id("pi-07") and "pi-07" in tp._VALID_IDS


def test_interleaved_messages_from_two_senders():
    ex = Expectation(BIG, kinds="update", rounds=1)
    a = wire.split(wire.encode("update", 1, "pi-01", {"params": params(BIG, 1)}, None, BIG),
                   KB128)
    b = wire.split(wire.encode("update", 1, "pi-02", {"params": params(BIG, 2)}, None, BIG),
                   KB128)
    r = wire.Reassembler()
    order = a + b
    random.Random(3).shuffle(order)
    frames = {f.sender: f for f in (r.add(c, ex) for c in order) if f is not None}
    assert sorted(frames) == ["pi-01", "pi-02"]
    assert np.array_equal(frames["pi-02"].buffers["params"], params(BIG, 2))


def test_incomplete_message_times_out():
    clock = Clock()
    ex = Expectation(BIG, kinds="update", rounds=1)
    chunks = wire.split(wire.encode("update", 1, "pi-01", {"params": params(BIG)}, None, BIG),
                        KB128)
    r = wire.Reassembler(timeout_s=10, clock=clock)
    for c in chunks[:3]:
        assert r.add(c, ex) is None
    assert r.pending == 1 and r.bytes_in_flight == chunk_total(chunks[0])
    clock.t += 9.5
    assert r.expire() == [] and r.pending == 1
    clock.t += 1.0
    reasons = r.expire()
    assert len(reasons) == 1 and "reassembly timeout" in reasons[0]
    assert f"3 of {len(chunks)} chunks after 10.5 s" in reasons[0] and "'pi-01'" in reasons[0]
    assert r.pending == 0 and r.bytes_in_flight == 0
    # the rest arrives too late: it starts over and never completes without the first three
    assert all(r.add(c, ex) is None for c in chunks[3:])
    assert r.pending == 1
    clock.t += 11
    assert r.add(an_update(), expect_update()) is not None    # add() expires old ones too
    assert r.pending == 0


def test_memory_bound_rejects_with_a_reason():
    ex = Expectation(BIG, kinds="update", rounds=1)
    msgs = [wire.split(wire.encode("update", 1, f"pi-0{i}", {"params": params(BIG, i)}, None,
                                   BIG), KB128) for i in range(3)]
    total = chunk_total(msgs[0][0])
    with pytest.raises(FrameError) as info:
        wire.Reassembler(max_bytes=total - 1).add(msgs[0][0], ex)
    assert info.value.code == "memory"
    assert f"a {total}-byte message does not fit: 0 of {total - 1} bytes" in info.value.reason
    r = wire.Reassembler(max_bytes=2 * total + 100)
    r.add(msgs[0][0], ex)
    r.add(msgs[1][0], ex)
    with pytest.raises(FrameError, match=f"{2 * total} of {2 * total + 100} bytes already "
                                         r"reserved by 2 incomplete"):
        r.add(msgs[2][0], ex)
    assert r.bytes_in_flight == 2 * total
    frames = [r.add(c, ex) for c in msgs[0][1:]]
    assert frames[-1].sender == "pi-00" and r.bytes_in_flight == total
    assert r.add(msgs[2][0], ex) is None                       # room again
    assert r.bytes_in_flight == 2 * total


def test_pending_messages_per_sender_are_bounded():
    ex = Expectation(BIG, kinds="update", rounds=1)
    r = wire.Reassembler(max_pending_per_sender=2)
    for i in range(2):
        r.add(wire.split(wire.encode("update", 1, "pi-01", {"params": params(BIG)}, None, BIG),
                         KB128)[0], ex)
    with pytest.raises(FrameError, match="already has 2 incomplete message"):
        r.add(wire.split(wire.encode("update", 1, "pi-01", {"params": params(BIG)}, None, BIG),
                         KB128)[0], ex)


def test_discarded_incomplete_messages_free_their_senders_slots_and_memory():
    """discard(sender, rounds): the incomplete messages of that sender in those rounds go,
    their memory is released and the sender may start new ones up to its limit again;
    other senders' and other rounds' stay, and complete as before."""
    ex = Expectation(BIG, kinds="update")
    r = wire.Reassembler(max_pending_per_sender=2)
    messages = {(sender, rnd): wire.split(wire.encode("update", rnd, sender,
                                                      {"params": params(BIG, seed=rnd)},
                                                      None, BIG), KB128)
                for sender in ("pi-01", "pi-02") for rnd in (1, 2, 3)}
    for key in [("pi-01", 1), ("pi-01", 2), ("pi-02", 1)]:
        assert r.add(messages[key][0], ex) is None            # first chunks only
    with pytest.raises(FrameError, match="already has 2 incomplete message"):
        r.add(messages[("pi-01", 3)][0], ex)
    reserved = r.bytes_in_flight
    assert r.discard("pi-01", {1}) == 1 and r.pending == 2
    assert r.bytes_in_flight < reserved
    assert r.add(messages[("pi-01", 3)][0], ex) is None        # a slot free again
    assert r.discard("pi-01", range(2)) == 0                    # nothing of round 1 left
    assert r.discard(None, {1}) == 1                            # pi-02's round 1
    frames = [r.add(c, ex) for c in messages[("pi-01", 2)][1:]]
    assert frames[-1] is not None and frames[-1].round == 2     # kept, completes
    assert r.discard() == 1 and r.pending == 0 and r.bytes_in_flight == 0
    assert r.stats["discarded"] == 3


def test_chunks_are_checked_before_they_are_buffered():
    data = wire.encode("update", 4, "pi-01", {"params": params(BIG)}, None, BIG)
    chunks = wire.split(data, KB128)
    r = wire.Reassembler()
    for ex, code, fragment in [
        (Expectation(BIG, kinds="update", rounds=5), "unexpected_round", "chunk 1/"),
        (Expectation(BIG, kinds="update", topic_sender="pi-02"), "sender", "topic of 'pi-02'"),
        (Expectation(BIG, kinds="model"), "unexpected_kind", "kind update"),
        (Expectation(TABLE, kinds="update"), "table_hash", "another model"),
    ]:
        with pytest.raises(FrameError) as info:
            r.add(chunks[0], ex)
        assert info.value.code == code and fragment in info.value.reason, info.value.reason
        assert r.bytes_in_flight == 0 and r.pending == 0
    ex = Expectation(BIG, kinds="update", rounds=4, topic_sender="pi-01")
    bad = bytearray(chunks[1])
    bad[-1] ^= 1
    with pytest.raises(FrameError, match="crc mismatch"):
        r.add(bytes(bad), ex)
    assert r.add(chunks[0], ex) is None
    # a sealed chunk whose metadata disagrees with its siblings
    forged = with_meta(chunks[1], lambda m: dict(m, total=m["total"] + 16))
    with pytest.raises(FrameError, match=r"disagrees with earlier chunks.*total"):
        r.add(forged, ex)
    forged = with_meta(chunks[1], lambda m: dict(m, offset=m["total"] - 10))
    with pytest.raises(FrameError, match="beyond the message's"):
        r.add(forged, ex)
    forged = with_meta(chunks[1], lambda m: dict(m, sender="pi-01", total="x"))
    with pytest.raises(FrameError, match="'total' must be an integer"):
        r.add(forged, ex)
    forged = with_meta(chunks[1], lambda m: dict(m, offset=0))   # overlaps chunk 0
    assert r.add(forged, ex) is None
    assert all(r.add(c, ex) is None for c in chunks[2:-1])
    with pytest.raises(FrameError, match="do not tile it: overlap at byte"):
        r.add(chunks[-1], ex)
    assert r.pending == 0 and r.bytes_in_flight == 0
    assert r.add(chunks[1], ex) is None          # that message id is spent, not re-buffered
    assert r.pending == 0


def test_a_chunk_that_would_hold_more_than_its_message_is_refused_on_arrival():
    # a message's chunks hold at most its total, the bytes charged against the sender's
    # limits: a chunk repeating bytes already held is refused when it comes, not kept
    # (with the rest of the sender's chunk indices) until the last chunk shows the overlap
    data = wire.encode("update", 4, "pi-01", {"params": params(BIG)}, None, BIG)
    chunks = wire.split(data, KB128)
    ex = Expectation(BIG, kinds="update", rounds=4, topic_sender="pi-01")
    r = wire.Reassembler()
    assert r.add(chunks[0], ex) is None
    h = header_fields(chunks[1])
    meta = json.loads(chunks[1][64:64 + h["meta_len"]])
    again = build(dict(meta, offset=0), bytes(data), kind=h["kind"], dtype=h["dtype"],
                  flags=h["flags"], round=h["round"], chunk_index=1,
                  chunk_count=h["chunk_count"], table_hash=h["table_hash"],
                  message_id=h["message_id"])
    with pytest.raises(FrameError, match=f"its {len(data)} bytes overlap earlier chunks"):
        r.add(again, ex)


def chunks_of(whole: bytes, room: int, *, sender="pi-07", kind=3, round=5, message_id=42,
              table_hash=None) -> list:
    """`whole` cut into chunks of `room` bytes, each laid out by hand (build) as section 5
    says: for a whole frame split() would refuse to cut, or one whose header the chunks'
    headers are to disagree with."""
    n = -(-len(whole) // room)
    return [build({"sender": sender, "offset": i * room, "total": len(whole)},
                  whole[i * room:(i + 1) * room], kind=kind, dtype=4, flags=1, round=round,
                  chunk_index=i, chunk_count=n, table_hash=table_hash, message_id=message_id)
            for i in range(n)]


@pytest.mark.parametrize("digests", [False, True])
def test_a_chunked_frame_with_deeply_nested_metadata_is_refused_as_a_frame_error(digests):
    # A receiver checking signatures (digests) reads the whole frame's metadata from its
    # first chunk to hash the frame along its chunks; metadata nested a few thousand
    # levels deep made that read raise RecursionError out of add() (any board could stop
    # the aggregator with one chunk on its own update topic), where it must be the
    # FrameError the whole frame gets.
    inner = build(b"[" * 3000 + b"]" * 3000, bytes(16384))
    assert b"[[[" in inner
    ex = expect_update()
    r = wire.Reassembler(digests=digests)
    first, *rest = chunks_of(inner, 8192)
    assert r.add(first, ex) is None
    with pytest.raises(FrameError) as info:
        for c in rest:
            r.add(c, ex)
    assert info.value.code == "metadata" and "not valid JSON" in info.value.reason
    assert r.pending == 0 and r.bytes_in_flight == 0


def test_chunks_whose_metadata_dwarfs_their_payload_hold_no_more_than_is_reserved():
    # A chunk's metadata may be up to 1 MiB (JSON whitespace included) while the message it
    # starts reserves only its declared total: had the reassembler kept each chunk's
    # payload as a view into the received bytes, four such chunks of one sender held 4 MiB
    # against 256 reserved bytes, on any board's own update topic.
    import gc
    import tracemalloc
    ex = expect_update()
    r = wire.Reassembler(max_bytes=1 << 20)
    pad = b" " * ((1 << 20) - 200)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(4):
            chunk = build(b'{"sender":"pi-07",' + pad + b'"offset":0,"total":64}',
                          bytes(range(32)), dtype=4, flags=1, chunk_count=2,
                          message_id=100 + i)
            assert r.add(chunk, ex) is None
            del chunk
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert r.pending == 4 and r.bytes_in_flight == 4 * 64 and r.bytes_buffered == 4 * 32
    assert held < 64 << 10, f"{held} bytes held for {r.bytes_in_flight} reserved"


# --------------------------------------------------------------- fuzz

def _fuzz_corpus():
    yield wire.encode("update", 5, "pi-07", {"params": params()}, {"num_samples": 1}, TABLE), \
        expect_update()
    yield an_update("f16"), expect_update()
    yield an_update("int8"), expect_update()
    yield wire.encode("client_model", 5, "agg", {"params": params(), "m": params(seed=9)},
                      {"tau": [1, 2]}, TABLE, "int8", recipient="pi-01"), \
        Expectation(TABLE, topic_recipient="pi-01")
    yield wire.encode("onnx", 2, "agg", {"model.onnx": bytes(range(200))}, None), \
        Expectation(None, kinds="onnx")


def _mutate(rng, data: bytes) -> bytes:
    op = rng.integers(0, 5)
    if op == 0:                                   # truncate
        return data[:rng.integers(0, len(data))]
    if op == 1:                                   # append junk
        return data + rng.bytes(int(rng.integers(1, 40)))
    b = bytearray(data)
    for _ in range(int(rng.integers(1, 5))):      # flip bytes anywhere, mostly near the front
        at = int(rng.integers(0, min(len(b), 400) if rng.random() < 0.8 else len(b)))
        b[at] = int(rng.integers(0, 256)) if op == 2 else b[at] ^ (1 << int(rng.integers(0, 8)))
    if op == 4:                                   # and reseal: get past the CRCs
        return reseal(bytes(b)) if len(b) >= 64 else bytes(b)
    return bytes(b)


def test_fuzz_decode_only_ever_raises_frame_error():
    rng = np.random.default_rng(20240611)
    corpus = list(_fuzz_corpus())
    chunked = wire.split(corpus[3][0], 256)
    outcomes = {"ok": 0, "rejected": 0}
    codes = set()
    r = wire.Reassembler(max_bytes=1 << 20)
    for i in range(4000):
        data, ex = corpus[i % len(corpus)]
        mutated = _mutate(rng, data)
        try:
            frame = wire.decode(mutated, ex)
        except FrameError as exc:
            outcomes["rejected"] += 1
            codes.add(exc.code)
            assert exc.reason and str(exc) == exc.reason
        else:
            outcomes["ok"] += 1
            assert isinstance(frame, wire.Frame)
            for buf in frame.buffers.values():
                assert not buf.flags.writeable
                if frame.dtype != "bytes":
                    assert buf.size == TABLE.size and np.all(np.isfinite(buf))
        chunk = chunked[i % len(chunked)]
        try:
            r.add(_mutate(rng, chunk) if i % 3 else chunk, corpus[3][1])
        except FrameError as exc:
            codes.add(exc.code)
    assert outcomes["rejected"] > 3000 and outcomes["ok"] > 0   # resealed payload flips pass
    assert {"truncated", "header_crc", "crc", "magic", "size"} <= codes


# --------------------------------------------------------------- topics

def test_topics_build_every_kind_under_prefix_and_federation():
    t = Topics("fed1")
    assert t.round() == "edgefl/fed1/round"
    assert t.model() == "edgefl/fed1/model"
    assert t.client_model("pi-07") == "edgefl/fed1/model/pi-07"
    assert t.update("pi-07") == "edgefl/fed1/update/pi-07"
    assert t.status("aggregator") == "edgefl/fed1/status/aggregator"
    assert t.metrics("pi-07") == "edgefl/fed1/metrics/pi-07"
    assert t.onnx() == "edgefl/fed1/onnx"
    assert t.ctl() == "edgefl/fed1/ctl"
    assert t.events() == "edgefl/fed1/events"
    assert t.subscription("update") == "edgefl/fed1/update/+"
    assert t.subscription("round") == "edgefl/fed1/round"
    site = Topics("fed1", prefix="site-3/fl")
    assert site.update("7") == "site-3/fl/fed1/update/7"
    assert site.parse("site-3/fl/fed1/update/7") == ("update", "7")


def test_topic_table_matches_the_design():
    assert {k: (s.retained, s.qos, s.payload) for k, s in TOPIC_TABLE.items()} == {
        "round": (True, 1, "json"), "model": (True, 1, "frame"),
        "client_model": (True, 1, "frame"), "task": (True, 1, "json"),
        "update": (False, 1, "frame"),
        "status": (True, 1, "json"), "metrics": (False, 0, "json"),
        "onnx": (True, 1, "frame"), "ctl": (False, 1, "json"), "events": (False, 1, "json"),
        "reply": (False, 1, "json"), "runs": (True, 1, "json"),
        "secure": (False, 1, "secagg"), "secure_to": (False, 1, "secagg")}
    assert set(wire.KINDS) == {k for k, s in TOPIC_TABLE.items() if s.payload == "frame"}


def test_topics_parse_round_trips_and_rejects_foreign_topics():
    t = Topics("fed1")
    for kind, spec in TOPIC_TABLE.items():
        node = "node-1" if spec.per_node else None
        assert t.parse(t.topic(kind, node)) == (kind, node)
    for topic, fragment in [
        ("edgefl/fed2/round", "not under 'edgefl/fed1/'"),
        ("other/fed1/round", "not under"),
        ("edgefl/fed1", "not under"),
        ("edgefl/fed1/weights", "unknown kind 'weights'"),
        ("edgefl/fed1/update", "needs a node id"),
        ("edgefl/fed1/update/", "empty"),
        ("edgefl/fed1/update/a/b", "1 extra level(s)"),
        ("edgefl/fed1/round/x", "takes no further levels"),
        ("edgefl/fed1/update/+", "contains '+'"),
        ("edgefl/fed1/status/a\x00b", "control character U+0000"),
    ]:
        with pytest.raises(TopicError, match=re.escape(fragment)):
            t.parse(topic)
    with pytest.raises(TopicError, match="must be a string"):
        t.parse(b"edgefl/fed1/round")


def test_ids_are_validated():
    assert validate_id("pi-07") == "pi-07" and validate_id("Küche-3") == "Küche-3"
    assert validate_id("x" * tp.MAX_ID_BYTES)
    for bad, fragment in [("", "empty"), ("a+b", "'+'"), ("a#", "'#'"), ("a/b", "'/'"),
                          ("a\x00", "U+0000"), ("a\n", "U+000A"), ("a\x85", "U+0085"),
                          ("x" * 65, "65 bytes"), ("€" * 22, "66 bytes"), (7, "must be a string"),
                          ("\ud800", "surrogate")]:
        with pytest.raises(TopicError, match=re.escape(fragment)):
            validate_id(bad, "client id")
    with pytest.raises(TopicError, match="federation id"):
        Topics("a/b")
    with pytest.raises(TopicError, match="reserve"):
        Topics("fed", prefix="$SYS")
    with pytest.raises(TopicError, match="level 2"):
        Topics("fed", prefix="a//b")
    t = Topics("fed")
    with pytest.raises(TopicError, match="needs a node id"):
        t.topic("update")
    with pytest.raises(TopicError, match="has no node level"):
        t.topic("round", "x")
    with pytest.raises(TopicError, match="unknown topic kind"):
        t.topic("weights")
    with pytest.raises(TopicError, match="update node id"):
        t.update("a+")
