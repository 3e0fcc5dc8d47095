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
"""
from __future__ import annotations

import bisect
import json
import logging
import math
import os
import struct
import threading
import time
import types
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np

from .. import kernels
from ..errors import KernelError
from ..params import LayerTable

try:
    # zlib-ng's CRC-32 (PCLMULQDQ / VPCLMULQDQ on x86-64, PMULL and the CRC32 instructions on
    # aarch64): the same checksum as zlib's, measured here at 56 GB/s where zlib's reaches
    # 4.2. Every byte of every frame is checksummed once or twice on the way in and out, and
    # with zlib that was the largest single cost of a round (tools/bench_transport.py
    # --only round). A dependency where it ships wheels (x86-64, aarch64; pyproject.toml);
    # elsewhere (armv7) the standard library's zlib computes the same values.
    from zlib_ng.zlib_ng import crc32 as _crc32
    CRC32_IMPL = "zlib-ng"
except ImportError:      # pragma: no cover - exercised on boards without the wheel
    from zlib import crc32 as _crc32
    CRC32_IMPL = "zlib"
from .topics import TopicError, validate_id

log = logging.getLogger("edgefl.transport.wire")

MAGIC = b"EDFL"
VERSION = 1
HEADER_SIZE = 64
ALIGN = 16
# bytes [0, 60) of the header; the last 4 bytes are the CRC32 of these 60
_HEAD = struct.Struct("<4sBBBBIIIIQQQI8x")
_U32 = struct.Struct("<I")
assert _HEAD.size + _U32.size == HEADER_SIZE

FLAG_CHUNK = 0x01            # the payload is a slice of a whole frame (see split)
KNOWN_FLAGS = FLAG_CHUNK
MAX_META_BYTES = 1 << 20     # metadata beyond this is refused before it is parsed
MAX_NAME_CHARS = 128         # buffer names
MAX_JSON_DEPTH = 16          # nesting of scalar values

KINDS = {"model": 1, "client_model": 2, "update": 3, "onnx": 4}
DTYPES = {"f32": 1, "f16": 2, "i8": 3, "bytes": 4}
COMPRESSIONS = {"none": "f32", "f16": "f16", "int8": "i8"}   # encode(compression=) -> dtype
ITEMSIZE = {"f32": 4, "f16": 2, "i8": 1, "bytes": 1}
TENSOR_KINDS = frozenset({"model", "client_model", "update"})  # float payloads, need a table
BLOB_KINDS = frozenset({"onnx"})                                # byte payloads
_KIND_NAMES = {v: k for k, v in KINDS.items()}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_F16_OVERFLOW = 65520.0      # float32 values at or beyond this round to float16 infinity
_F32_MAX = float(np.finfo(np.float32).max)


class FrameError(ValueError):
    """A received frame (or chunk) that failed a check. `code` names the check, `reason`
    says what was wrong in words fit for a log line."""

    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


class EncodeError(ValueError):
    """Something encode() or split() refuses to put on the wire; the message names it."""


# ---------------------------------------------------------------------------------------
# header
# ---------------------------------------------------------------------------------------

def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Header(NamedTuple):
    """The fixed header of a frame, checked (magic, version, header CRC, known values, sizes).
    A NamedTuple rather than a frozen dataclass: every chunk of every frame makes one, and a
    frozen dataclass's __init__ costs several times a tuple's."""

    kind: str
    dtype: str
    flags: int
    round: int
    chunk_index: int
    chunk_count: int
    meta_len: int
    payload_len: int
    table_hash: int
    message_id: int
    crc: int

    @property
    def is_chunk(self) -> bool:
        return bool(self.flags & FLAG_CHUNK)

    @property
    def data_offset(self) -> int:
        """Where the payload starts: the header, the metadata, padding to 16 bytes."""
        return HEADER_SIZE + _align(self.meta_len)

    @property
    def frame_len(self) -> int:
        return self.data_offset + self.payload_len

    def describe(self) -> str:
        what = f"{self.kind} round {self.round} message {self.message_id:016x}"
        if self.is_chunk:
            what += f" chunk {self.chunk_index + 1}/{self.chunk_count}"
        return what


def _pack_header(kind: str, dtype: str, flags: int, round: int, chunk_index: int,
                 chunk_count: int, meta_len: int, payload_len: int, table_hash: int,
                 message_id: int, crc: int) -> bytes:
    head = _HEAD.pack(MAGIC, VERSION, KINDS[kind], DTYPES[dtype], flags, round, chunk_index,
                      chunk_count, meta_len, payload_len, table_hash, message_id, crc)
    return head + _U32.pack(_crc32(head))


def _as_view(data) -> memoryview:
    if isinstance(data, (bytes, bytearray)):
        return memoryview(data)
    if isinstance(data, memoryview):
        if not data.c_contiguous:
            raise TypeError("frame data: memoryview is not contiguous")
        return data.cast("B") if (data.format != "B" or data.ndim != 1) else data
    raise TypeError(f"frame data: need bytes, bytearray or memoryview, got {type(data).__name__}")


def read_header(data) -> Header:
    """Parse and check the header of a frame or chunk, and that `data` has exactly the size
    the header announces. Does not read the metadata or the payload (no body CRC)."""
    mv = _as_view(data)
    n = len(mv)
    if n == 0:
        raise FrameError("truncated", "empty payload (0 bytes; a cleared retained message?)")
    if n < len(MAGIC) and MAGIC.startswith(bytes(mv)):
        raise FrameError("truncated", f"truncated: {n} bytes, a frame header alone is "
                                      f"{HEADER_SIZE}")
    if bytes(mv[:len(MAGIC)]) != MAGIC:
        raise FrameError("magic", f"bad magic {bytes(mv[:len(MAGIC)])!r}, expected {MAGIC!r}: "
                                  "not an edgefl frame")
    if n < HEADER_SIZE:
        raise FrameError("truncated", f"truncated: {n} bytes, a frame header alone is "
                                      f"{HEADER_SIZE}")
    (_, version, kind, dtype, flags, round_, chunk_index, chunk_count, meta_len, payload_len,
     table_hash, message_id, crc) = _HEAD.unpack_from(mv, 0)
    if version != VERSION:
        raise FrameError("version", f"frame version {version}, this reader knows {VERSION}")
    header_crc = _U32.unpack_from(mv, _HEAD.size)[0]
    computed = _crc32(mv[:_HEAD.size])
    if header_crc != computed:
        raise FrameError("header_crc", f"header crc mismatch: stored 0x{header_crc:08x}, "
                                       f"computed 0x{computed:08x} over header bytes 0..59")
    if any(mv[52:60]):
        raise FrameError("reserved", "reserved header bytes 52..59 are not zero "
                                     f"({bytes(mv[52:60]).hex()}): written by a newer version?")
    if flags & ~KNOWN_FLAGS:
        raise FrameError("flags", f"unknown flag bits 0x{flags & ~KNOWN_FLAGS:02x} in flags "
                                  f"0x{flags:02x}")
    if kind not in _KIND_NAMES:
        raise FrameError("kind", f"unknown kind {kind}; known: "
                                 + ", ".join(f"{v}={k}" for k, v in KINDS.items()))
    if dtype not in _DTYPE_NAMES:
        raise FrameError("dtype", f"unknown dtype {dtype}; known: "
                                  + ", ".join(f"{v}={k}" for k, v in DTYPES.items()))
    h = Header(_KIND_NAMES[kind], _DTYPE_NAMES[dtype], flags, round_, chunk_index, chunk_count,
               meta_len, payload_len, table_hash, message_id, crc)
    if h.is_chunk:
        if h.dtype != "bytes":
            raise FrameError("dtype", f"{h.describe()}: a chunk carries dtype bytes, "
                                      f"header says {h.dtype}")
        if not 0 <= chunk_index < chunk_count:
            raise FrameError("chunk", f"{h.describe()}: chunk index {chunk_index} not below "
                                      f"count {chunk_count}")
    else:
        if (chunk_index, chunk_count) != (0, 1):
            raise FrameError("chunk", f"{h.describe()}: a whole frame has chunk 0 of 1, header "
                                      f"says {chunk_index} of {chunk_count}")
        if (h.kind in BLOB_KINDS) != (h.dtype == "bytes"):
            carries = "bytes" if h.kind in BLOB_KINDS else "f32, f16 or i8"
            raise FrameError("dtype", f"{h.describe()}: {h.kind} frames carry {carries}, header "
                                      f"says dtype {h.dtype}")
    if meta_len > MAX_META_BYTES:
        raise FrameError("size", f"{h.describe()}: metadata length {meta_len} exceeds the "
                                 f"{MAX_META_BYTES}-byte limit")
    if n != h.frame_len:
        what = "truncated" if n < h.frame_len else "size"
        raise FrameError(what, f"{h.describe()}: frame is {n} bytes, header says "
                               f"{h.frame_len} ({HEADER_SIZE} header + {_align(meta_len)} "
                               f"metadata + {payload_len} payload)")
    return h


def verify(data) -> Header:
    """The header of a whole frame or chunk whose header and body CRCs hold: bytes that are
    the ones a sender wrote, torn by nothing. No expectation, metadata or value checks (a
    frame read back from one's own disk, say; decode() does the rest)."""
    mv = _as_view(data)
    h = read_header(mv)
    _check_body_crc(mv, h)
    return h


# ---------------------------------------------------------------------------------------
# what a receiver expects
# ---------------------------------------------------------------------------------------

def _names(value, known, what) -> frozenset:
    items = frozenset([value] if isinstance(value, str) else value)
    unknown = sorted(items - frozenset(known))
    if unknown:
        raise ValueError(f"Expectation.{what}: unknown {unknown}; valid: {sorted(known)}")
    return items


@dataclass(frozen=True)
class Expectation:
    """What a receiver will accept; decode() rejects every frame outside it.

    table:           the model's LayerTable: frames must carry its hash64, tensors its size.
                     None only when `kinds` holds nothing but blob kinds (onnx).
    kinds:           accepted kinds (a name or names from KINDS).
    rounds:          None (any), a round number, or a container of them (set, range).
    senders:         None (any) or the accepted sender ids (e.g. the aggregator's id).
    topic_sender:    the node id of the topic the frame arrived on when that topic names its
                     sender (update/<client>): the frame's sender must equal it.
    topic_recipient: the node id of a model/<client> topic: the frame's recipient must equal it.
    dtypes:          accepted payload dtypes (e.g. {"f32"} to refuse compressed models).
    """

    table: LayerTable | None
    kinds: Any = frozenset(KINDS)
    rounds: Any = None
    senders: Any = None
    topic_sender: str | None = None
    topic_recipient: str | None = None
    dtypes: Any = frozenset(DTYPES)

    def __post_init__(self):
        kinds = _names(self.kinds, KINDS, "kinds")
        object.__setattr__(self, "kinds", kinds)
        object.__setattr__(self, "dtypes", _names(self.dtypes, DTYPES, "dtypes"))
        if self.table is None and kinds & TENSOR_KINDS:
            raise ValueError(f"Expectation: kinds {sorted(kinds & TENSOR_KINDS)} carry tensors; "
                             "give the model's LayerTable to check them against")
        if self.table is not None and not isinstance(self.table, LayerTable):
            raise ValueError(f"Expectation.table: need a LayerTable, got "
                             f"{type(self.table).__name__}")
        rounds = self.rounds
        if rounds is not None and not isinstance(rounds, range):
            rounds = frozenset([rounds] if isinstance(rounds, int) else rounds)
            if not all(isinstance(r, int) for r in rounds):
                raise ValueError(f"Expectation.rounds: need ints, got {sorted(rounds, key=str)}")
        object.__setattr__(self, "rounds", rounds)
        if self.senders is not None:
            senders = frozenset([self.senders] if isinstance(self.senders, str) else self.senders)
            object.__setattr__(self, "senders", senders)

    @classmethod
    def for_topic(cls, topic_kind: str, node: str | None, table: LayerTable | None,
                  **kw) -> Expectation:
        """The expectation for a frame that arrived on a topic parsed by Topics.parse."""
        if topic_kind == "update":
            return cls(table, kinds="update", topic_sender=node, **kw)
        if topic_kind == "client_model":
            return cls(table, kinds="client_model", topic_recipient=node, **kw)
        if topic_kind in ("model", "onnx"):
            return cls(table, kinds=topic_kind, **kw)
        raise ValueError(f"topic kind {topic_kind!r} carries JSON, not frames")

    def describe_rounds(self) -> str:
        r = self.rounds
        if isinstance(r, range):
            return f"{r.start}..{r.stop - 1}" + (f" step {r.step}" if r.step != 1 else "")
        return ", ".join(str(x) for x in sorted(r)) if r else "none"


def _check_header_expectation(h: Header, expect: Expectation) -> None:
    if h.kind not in expect.kinds:
        raise FrameError("unexpected_kind", f"{h.describe()}: kind {h.kind} not expected here "
                                            f"(expected {', '.join(sorted(expect.kinds))})")
    if expect.rounds is not None and h.round not in expect.rounds:
        raise FrameError("unexpected_round", f"{h.describe()}: round {h.round} not expected "
                                             f"(expected {expect.describe_rounds()})")
    table = expect.table
    if table is None:
        if h.kind in TENSOR_KINDS:  # unreachable through Expectation, kept as a guard
            raise FrameError("table_hash", f"{h.describe()}: no layer table to check against")
    elif h.table_hash != table.hash64 and not (h.kind in BLOB_KINDS and h.table_hash == 0):
        raise FrameError("table_hash", f"{h.describe()}: table hash 0x{h.table_hash:016x} does "
                                       f"not match the model's 0x{table.hash64:016x} (layer table "
                                       f"{table.digest[:12]}, {len(table)} layers, {table.size} "
                                       "parameters): a frame for another model")
    if not h.is_chunk and h.dtype not in expect.dtypes:
        raise FrameError("dtype", f"{h.describe()}: dtype {h.dtype} not accepted here "
                                  f"(accepted: {', '.join(sorted(expect.dtypes))})")


def _check_body_crc(mv: memoryview, h: Header) -> None:
    computed = _crc32(mv[HEADER_SIZE:])
    if computed != h.crc:
        raise FrameError("crc", f"{h.describe()}: crc mismatch: header 0x{h.crc:08x}, computed "
                                f"0x{computed:08x} over bytes {HEADER_SIZE}..{len(mv) - 1} "
                                "(metadata + padding + payload)")


# ---------------------------------------------------------------------------------------
# metadata
# ---------------------------------------------------------------------------------------

def _reject_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:20]} overflows to {v}")
    return v


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


# One decoder for all metadata: json.loads with options builds a new JSONDecoder per call,
# which was a sixth of the per-chunk cost of reassembly.
_META_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float,
                                 object_pairs_hook=_no_duplicates)


def _parse_meta(mv: memoryview, h: Header) -> dict:
    raw = bytes(mv[HEADER_SIZE:HEADER_SIZE + h.meta_len])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FrameError("metadata", f"{h.describe()}: metadata is not UTF-8 ({exc})") from None
    try:
        if text.startswith("\ufeff"):       # as json.loads refuses it
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        meta = _META_DECODER.decode(text)
    except (ValueError, RecursionError) as exc:
        raise FrameError("metadata", f"{h.describe()}: metadata is not valid JSON "
                                     f"({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(meta, dict):
        raise FrameError("metadata", f"{h.describe()}: metadata must be a JSON object, got "
                                     f"{type(meta).__name__}")
    pad = mv[HEADER_SIZE + h.meta_len:h.data_offset]
    if any(pad):
        raise FrameError("padding", f"{h.describe()}: padding bytes after the metadata are not "
                                    "zero")
    return meta


def _meta_keys(meta: dict, required: Iterable[str], optional: Iterable[str], h: Header) -> None:
    missing = [k for k in required if k not in meta]
    unknown = sorted(set(meta) - set(required) - set(optional))
    if missing or unknown:
        raise FrameError("metadata", f"{h.describe()}: metadata keys: missing {missing}, "
                                     f"unknown {unknown}")


def _meta_int(meta: Mapping, key: str, h: Header, what: str, lo: int = 0,
              hi: int | None = None) -> int:
    v = meta.get(key)
    if type(v) is not int or v < lo or (hi is not None and v > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise FrameError("metadata", f"{h.describe()}: {what} {key!r} must be an integer "
                                     f"{bound}, got {v!r}")
    return v


def _check_parties(meta: dict, h: Header, expect: Expectation) -> tuple:
    """(sender, recipient) from the metadata, checked against the expectation and topic."""
    sender = meta.get("sender")
    try:
        validate_id(sender, "sender")
    except TopicError as exc:
        raise FrameError("sender", f"{h.describe()}: metadata {exc}") from None
    if expect.topic_sender is not None and sender != expect.topic_sender:
        raise FrameError("sender", f"{h.describe()}: sender {sender!r} arrived on the topic of "
                                   f"{expect.topic_sender!r}")
    if expect.senders is not None and sender not in expect.senders:
        raise FrameError("sender", f"{h.describe()}: sender {sender!r} not expected (expected "
                                   f"{', '.join(sorted(expect.senders))})")
    recipient = meta.get("recipient")
    if h.kind == "client_model":
        try:
            validate_id(recipient, "recipient")
        except TopicError as exc:
            raise FrameError("recipient", f"{h.describe()}: metadata {exc}") from None
        if expect.topic_recipient is not None and recipient != expect.topic_recipient:
            raise FrameError("recipient", f"{h.describe()}: model for {recipient!r} arrived on "
                                          f"the topic of {expect.topic_recipient!r}")
    elif recipient is not None:
        raise FrameError("recipient", f"{h.describe()}: a {h.kind} frame has no recipient, "
                                      f"metadata names {recipient!r}")
    return sender, recipient


def _json_value(v, path: str, depth: int = 0, err=EncodeError):
    """v as plain JSON data (numpy scalars unwrapped), or err naming the path."""
    if depth > MAX_JSON_DEPTH:
        raise err(f"{path}: nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(v, np.generic):
        v = v.item()
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise err(f"{path} is {v}: JSON metadata carries finite numbers only (send None "
                      "for 'no value')")
        return float(v)
    if isinstance(v, (list, tuple)):
        return [_json_value(x, f"{path}[{i}]", depth + 1, err) for i, x in enumerate(v)]
    if isinstance(v, Mapping):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise err(f"{path}: key {k!r} is not a string")
            out[k] = _json_value(x, f"{path}.{k}", depth + 1, err)
        return out
    raise err(f"{path}: {type(v).__name__} is not a JSON value (numbers, strings, bools, None, "
              "lists, dicts)")


@dataclass(frozen=True)
class _BufferSpec:
    name: str
    offset: int
    size: int
    scales: np.ndarray | None


def _check_buffer_meta(meta: dict, h: Header, table: LayerTable | None) -> list:
    rows = meta.get("buffers")
    if not isinstance(rows, list):
        raise FrameError("metadata", f"{h.describe()}: 'buffers' must be a list, got "
                                     f"{type(rows).__name__}")
    itemsize = ITEMSIZE[h.dtype]
    specs, names, prev_end, prev_name = [], set(), 0, None
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise FrameError("metadata", f"{h.describe()}: buffers[{i}] must be an object")
        want = {"name", "offset", "size"} | ({"scales"} if h.dtype == "i8" else set())
        if set(row) != want:
            raise FrameError("metadata", f"{h.describe()}: buffers[{i}] has keys {sorted(row)}, "
                                         f"a {h.dtype} buffer has {sorted(want)}")
        name = row["name"]
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS \
                or any(ord(c) < 0x20 for c in name):
            raise FrameError("metadata", f"{h.describe()}: buffers[{i}] name {str(name)[:40]!r} "
                                         f"must be 1..{MAX_NAME_CHARS} printable characters")
        if name in names:
            raise FrameError("buffer", f"{h.describe()}: buffer {name!r} appears twice")
        names.add(name)
        offset = _meta_int(row, "offset", h, f"buffer {name!r}")
        size = _meta_int(row, "size", h, f"buffer {name!r}")
        if offset % ALIGN:
            raise FrameError("buffer", f"{h.describe()}: buffer {name!r} offset {offset} is not "
                                       f"a multiple of {ALIGN}")
        end = offset + size * itemsize
        if end > h.payload_len:
            raise FrameError("buffer", f"{h.describe()}: buffer {name!r} spans payload bytes "
                                       f"[{offset}, {end}) beyond the payload's {h.payload_len}")
        if offset < prev_end:
            raise FrameError("buffer", f"{h.describe()}: buffer {name!r} at payload offset "
                                       f"{offset} overlaps {prev_name!r} (ends at {prev_end}); "
                                       "buffers must be in payload order without overlaps")
        prev_end, prev_name = end, name
        if table is not None and h.dtype != "bytes" and size != table.size:
            raise FrameError("buffer", f"{h.describe()}: buffer {name!r} has {size} values, the "
                                       f"model's layer table has {table.size}")
        scales = None
        if h.dtype == "i8":
            scales = _check_scales(row["scales"], name, h, table)
        specs.append(_BufferSpec(name, offset, size, scales))
    return specs


def _check_scales(raw, name: str, h: Header, table: LayerTable) -> np.ndarray:
    if not isinstance(raw, list) or len(raw) != len(table):
        got = len(raw) if isinstance(raw, list) else type(raw).__name__
        raise FrameError("scales", f"{h.describe()}: buffer {name!r} needs {len(table)} int8 "
                                   f"scales (one per layer), got {got}")
    if not all(type(s) in (int, float) for s in raw):
        raise FrameError("scales", f"{h.describe()}: buffer {name!r} scales must be numbers")
    scales = np.array(raw, dtype=np.float64)
    bad = np.flatnonzero(~((scales > 0) & (scales <= _F32_MAX)))
    if bad.size:
        i = int(bad[0])
        raise FrameError("scales", f"{h.describe()}: buffer {name!r} scale of layer "
                                   f"{table.entries[i].name!r} is {raw[i]}; scales are > 0 and "
                                   "finite in float32")
    with np.errstate(over="ignore"):
        return scales.astype(np.float32)


# ---------------------------------------------------------------------------------------
# finite values
# ---------------------------------------------------------------------------------------

def _first_nonfinite(x: np.ndarray) -> int | None:
    """Index of the first NaN/Inf in a flat float32 array, or None (one kernel call: the C
    core scans at memory speed, and gives up the GIL once, not once per numpy block)."""
    return kernels.first_nonfinite(x)


def _layer_at(table: LayerTable | None, index: int) -> str:
    if table is None or not len(table):
        return ""
    starts = [e.offset for e in table.entries]
    return f" (layer {table.entries[bisect.bisect_right(starts, index) - 1].name!r})"


def _nonfinite_reason(x: np.ndarray, name: str, table: LayerTable | None) -> str | None:
    i = _first_nonfinite(x)
    if i is None:
        return None
    count = int(x.size - np.count_nonzero(np.isfinite(x)))
    return (f"buffer {name!r} holds {count} non-finite value(s); the first, {x[i]}, at index "
            f"{i}{_layer_at(table, i)}")


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
                 types.MappingProxyType(scalars), h.table_hash, h.message_id, len(mv))


# ---------------------------------------------------------------------------------------
# encode
# ---------------------------------------------------------------------------------------

_META_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _dumps(meta: dict) -> bytes:
    return _META_ENCODER.encode(meta).encode("utf-8")


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
           message_id: int | None = None) -> bytes:
    """One whole frame (chunk 0 of 1). Tensor kinds (model, client_model, update) take float32
    buffers of the table's size, all finite, sent as f32 ("none"), f16 or int8 with one scale
    per layer; blob kinds (onnx) take bytes-like buffers, compression "none". client_model
    frames name their `recipient`. EncodeError names anything refused."""
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
    meta_bytes = _dumps(meta)
    if len(meta_bytes) > MAX_META_BYTES:
        raise EncodeError(f"metadata is {len(meta_bytes)} bytes, the limit is {MAX_META_BYTES}")
    table_hash = table.hash64 if table is not None else 0
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


# ---------------------------------------------------------------------------------------
# chunking
# ---------------------------------------------------------------------------------------

def _chunk_meta(sender: str, recipient: str | None, offset: int, total: int) -> bytes:
    """A chunk's metadata: _dumps({sender, [recipient,] offset, total}), byte for byte."""
    return _chunk_meta_at(_chunk_meta_prefix(sender, recipient), offset, total)


def _chunk_meta_prefix(sender: str, recipient: str | None) -> bytes:
    """The bytes of a chunk's metadata before "offset", the same for every chunk of a frame
    (split() encodes them once)."""
    meta = {"sender": sender}
    if recipient is not None:
        meta["recipient"] = recipient
    return _dumps(meta)[:-1] + b","


def _chunk_meta_at(prefix: bytes, offset: int, total: int) -> bytes:
    return prefix + b'"offset":%d,"total":%d}' % (offset, total)


def split(frame, max_payload: int) -> list[bytes]:
    """The MQTT payloads for one whole frame, none longer than max_payload bytes.

    A frame that fits is returned as is ([frame]). Otherwise chunk i of n is itself a frame:
    flag CHUNK, dtype bytes, chunk index i and count n, the whole frame's kind, round, table
    hash and message id, metadata {sender, [recipient,] offset, total}, and as payload the
    whole frame's bytes [offset, offset + len)."""
    mv = _as_view(frame)
    try:
        h = read_header(mv)
    except FrameError as exc:
        raise EncodeError(f"split: not a valid frame ({exc.reason})") from None
    if h.is_chunk:
        raise EncodeError(f"split: {h.describe()} is already a chunk")
    max_payload = _check_u(max_payload, 63, "max_payload")
    if len(mv) <= max_payload:
        return [frame if isinstance(frame, bytes) else bytes(mv)]
    try:
        meta = _parse_meta(mv, h)
        sender, recipient = meta["sender"], meta.get("recipient")
    except (FrameError, KeyError) as exc:
        raise EncodeError(f"split: frame metadata unusable ({exc})") from None
    total = len(mv)
    prefix = _chunk_meta_prefix(sender, recipient)
    room = max_payload - HEADER_SIZE - _align(len(_chunk_meta_at(prefix, total, total)))
    if room < ALIGN:
        raise EncodeError(f"split: max_payload {max_payload} leaves no room for data after a "
                          f"chunk's {max_payload - room} bytes of header and metadata")
    count = -(-total // room)
    if count >= 2 ** 32:
        raise EncodeError(f"split: {count} chunks exceed the 32-bit chunk count")
    return [_assemble(h.kind, "bytes", FLAG_CHUNK, h.round, i, count, h.table_hash,
                      h.message_id, _chunk_meta_at(prefix, i * room, total),
                      [mv[i * room:(i + 1) * room]])
            for i in range(count)]


@dataclass
class _Partial:
    header: Header
    recipient: str | None
    total: int
    started: float
    reserved: int                               # bytes charged against the limits
    held: int = 0                               # bytes of the chunks received so far
    parts: dict = field(default_factory=dict)   # chunk index -> (offset, bytes-like)

    def describe(self, sender: str) -> str:
        h = self.header
        return (f"message {h.message_id:016x} from {sender!r} ({h.kind} round {h.round}, "
                f"{self.total} bytes)")


class Reassembler:
    """Turns received payloads (whole frames or chunks, any order) into checked Frames.

    add() returns the Frame when a message is complete and None while chunks are missing or
    when the payload repeats one already taken (QoS 1 redelivery: idempotent per (sender,
    message id, chunk); a completed message id is remembered, the last `remember` of them, so
    a redelivered chunk or frame is not delivered twice). Every chunk is checked on arrival
    (header, CRC, kind, round, table hash, sender and topic) before it is buffered; the
    reassembled frame is then decoded with the same Expectation.

    Limits (docs/limits.md), each refusal a FrameError:
    - memory: each incomplete message reserves its whole size on its first chunk; a message
      that would take the reserved total beyond `max_bytes`, a sender's reservations beyond
      `max_bytes_per_sender`, or a sender's incomplete messages beyond
      `max_pending_per_sender` is refused (code "memory"). The chunks held for a message
      never add up to more than its size (overlapping ones are refused on arrival), so the
      bytes buffered never exceed `bytes_in_flight`, which never exceeds `max_bytes`. A
      message has at most one chunk per 16 bytes and no empty chunk, which bounds the
      per-chunk bookkeeping too (and max_chunks_per_sender bounds it per round).
    - flooding: with `max_chunks_per_sender`, a sender may deliver that many payloads per
      round (chunks and whole frames, duplicates included: QoS 1 repeats are few, a flood is
      not). The payload over budget is refused (code "flood"), the sender's incomplete
      messages of that round are dropped and their memory released, and the sender is
      ignored for the rest of that round: its further payloads cost one header check and
      return None (counted in stats["ignored"], logged once). The sender is the topic's
      (Expectation.topic_sender), else the chunk's metadata.
    Incomplete messages are dropped `timeout_s` after their first chunk, by expire(), which
    add() also calls; drops are logged and returned by expire().

    Every refusal is counted in `rejected` (by code) and logged at DEBUG with its code (the
    caller decides what to tell the operator; the roles log one warning per message).
    `stats` counts frames, messages, chunks, duplicates, ignored, expired, floods; and
    `peak_bytes` is the most ever reserved at once. Thread-safe.
    """

    DEFAULT_MAX_BYTES = 256 << 20

    def __init__(self, timeout_s: float = 60.0, max_bytes: int = DEFAULT_MAX_BYTES, *,
                 max_pending_per_sender: int = 4, max_bytes_per_sender: int | None = None,
                 max_chunks_per_sender: int | None = None, remember: int = 4096,
                 clock: Callable[[], float] = time.monotonic):
        if not timeout_s > 0:
            raise ValueError(f"Reassembler: timeout_s {timeout_s} must be > 0")
        for name, value in (("max_bytes", max_bytes), ("max_pending_per_sender",
                                                       max_pending_per_sender),
                            ("max_bytes_per_sender", max_bytes_per_sender),
                            ("max_chunks_per_sender", max_chunks_per_sender),
                            ("remember", remember)):
            if value is None and name in ("max_bytes_per_sender", "max_chunks_per_sender"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                    or not value > 0:
                raise ValueError(f"Reassembler: {name} {value!r} must be an integer > 0")
        self.timeout_s = float(timeout_s)
        self.max_bytes = int(max_bytes)
        self.max_pending_per_sender = int(max_pending_per_sender)
        self.max_bytes_per_sender = int(max_bytes_per_sender) \
            if max_bytes_per_sender is not None else self.max_bytes
        self.max_chunks_per_sender = int(max_chunks_per_sender) \
            if max_chunks_per_sender is not None else None
        self.remember = int(remember)
        self._clock = clock
        self._partial: OrderedDict[tuple, _Partial] = OrderedDict()
        self._done: OrderedDict[tuple, None] = OrderedDict()
        self._reserved = 0
        self._budget: OrderedDict[tuple, int] = OrderedDict()     # (sender, round) -> payloads
        self._flooding: OrderedDict[tuple, None] = OrderedDict()  # (sender, round) ignored
        self.rejected: Counter = Counter()
        self.stats: Counter = Counter()
        self.peak_bytes = 0
        self._lock = threading.Lock()

    @property
    def bytes_in_flight(self) -> int:
        """Bytes reserved by incomplete messages."""
        return self._reserved

    @property
    def bytes_buffered(self) -> int:
        """Bytes of the chunks actually held (never more than bytes_in_flight)."""
        with self._lock:
            return sum(p.held for p in self._partial.values())

    @property
    def pending(self) -> int:
        """Incomplete messages held."""
        return len(self._partial)

    def expire(self) -> list[str]:
        """Drop incomplete messages older than timeout_s; return (and log) why each went."""
        with self._lock:
            return self._expire(self._clock())

    def _expire(self, now: float) -> list[str]:
        reasons = []
        for key in [k for k, p in self._partial.items() if now - p.started > self.timeout_s]:
            p = self._partial.pop(key)
            self._reserved -= p.reserved
            self.stats["expired"] += 1
            reason = (f"reassembly timeout: {p.describe(key[0])}: {len(p.parts)} of "
                      f"{p.header.chunk_count} chunks after {now - p.started:.1f} s "
                      f"(timeout {self.timeout_s:g} s); dropped")
            log.warning(reason)
            reasons.append(reason)
        return reasons

    def _mark_done(self, key: tuple) -> None:
        self._done[key] = None
        while len(self._done) > self.remember:
            self._done.popitem(last=False)

    # -- flooding -------------------------------------------------------------------------

    def is_flooding(self, sender: str, round: int) -> bool:
        """True once `sender` went over its chunk budget for `round` (it is ignored)."""
        return (sender, round) in self._flooding

    def charge(self, sender: str, round: int, what: str = "payload") -> bool:
        """Count one payload of `sender` for `round` against its budget (add() does this for
        what it is given; a caller that refuses a payload before add() -- not a frame at
        all -- charges it here). True: within budget. False: the sender is already ignored
        for this round. The payload that goes over budget raises FrameError "flood"; the
        transition is logged once, at WARNING."""
        with self._lock:
            try:
                return self._charge(sender, round, what)
            except FrameError as exc:
                self.rejected[exc.code] += 1
                log.debug("rejected [%s] %s", exc.code, exc.reason)
                raise

    def _charge(self, sender: str, round: int, what: str) -> bool:
        key = (sender, round)
        if key in self._flooding:
            self.stats["ignored"] += 1
            return False
        if self.max_chunks_per_sender is None:
            return True
        used = self._budget.pop(key, 0) + 1
        self._budget[key] = used                     # most recent last: trimmed LRU-first
        while len(self._budget) > self.remember:
            self._budget.popitem(last=False)
        if used <= self.max_chunks_per_sender:
            return True
        self._flooding[key] = None
        while len(self._flooding) > self.remember:
            self._flooding.popitem(last=False)
        dropped = [k for k, p in self._partial.items()
                   if k[0] == sender and p.header.round == round]
        released = 0
        for k in dropped:
            p = self._partial.pop(k)
            self._reserved -= p.reserved
            released += p.reserved
        self.stats["floods"] += 1
        log.warning("sender %r floods round %d: %s number %d is over its budget of %d per "
                    "round; dropped for this round (%d incomplete message(s), %d bytes "
                    "released); its further payloads for round %d are ignored", sender, round,
                    what, used, self.max_chunks_per_sender, len(dropped), released, round)
        raise FrameError("flood", f"{what} {used} of {sender!r} for round {round} is over "
                                  f"its budget of {self.max_chunks_per_sender} per round; the "
                                  f"sender is ignored for the rest of round {round}")

    # -- adding ---------------------------------------------------------------------------

    def add(self, data, expect: Expectation, *, charged: bool = False) -> Frame | None:
        """The Frame once `data` completes a message, else None (class docstring).
        charged: the caller already counted this payload against the sender's budget with
        charge() (a role that counts every payload of a topic, frames or not)."""
        try:
            return self._add(data, expect, charged)
        except FrameError as exc:
            with self._lock:
                self.rejected[exc.code] += 1
            log.debug("rejected [%s] %s", exc.code, exc.reason)
            raise

    def _add(self, data, expect: Expectation, charged: bool) -> Frame | None:
        mv = _as_view(data)
        with self._lock:
            now = self._clock()
            self._expire(now)
            h = read_header(mv)
            sender = expect.topic_sender
            # Charged before the costly checks (CRC, JSON) so that a flooder costs one header
            # parse per payload; only rounds the receiver expects, so a forged round number
            # cannot open budgets without end.
            if sender is not None and not charged \
                    and (expect.rounds is None or h.round in expect.rounds):
                if not self._charge(sender, h.round, "chunk" if h.is_chunk else "frame"):
                    return None
            if not h.is_chunk:
                frame = decode(data, expect)
                key = (frame.sender, h.message_id)
                if key in self._done:
                    self.stats["duplicates"] += 1
                    return None
                self._mark_done(key)
                self.stats["frames"] += 1
                return frame
            return self._add_chunk(data, mv, h, expect, now, charged)

    def _add_chunk(self, data, mv: memoryview, h: Header, expect: Expectation,
                   now: float, charged: bool) -> Frame | None:
        _check_header_expectation(h, expect)
        _check_body_crc(mv, h)
        meta = _parse_meta(mv, h)
        _meta_keys(meta, ("sender", "offset", "total"),
                   ("recipient",) if h.kind == "client_model" else (), h)
        sender, recipient = _check_parties(meta, h, expect)
        if expect.topic_sender is None and not charged \
                and not self._charge(sender, h.round, "chunk"):
            return None
        total = _meta_int(meta, "total", h, "chunk", lo=HEADER_SIZE)
        offset = _meta_int(meta, "offset", h, "chunk")
        if h.payload_len == 0:
            raise FrameError("chunk", f"{h.describe()}: an empty chunk (split() never makes one)")
        if offset + h.payload_len > total:
            raise FrameError("chunk", f"{h.describe()}: bytes [{offset}, "
                                      f"{offset + h.payload_len}) beyond the message's {total}")
        if h.chunk_count > -(-total // ALIGN):
            # split() puts at least ALIGN bytes in every chunk but the last
            raise FrameError("chunk", f"{h.describe()}: {h.chunk_count} chunks for {total} "
                                      f"bytes (at most one per {ALIGN} bytes)")
        key = (sender, h.message_id)
        if key in self._done:
            self.stats["duplicates"] += 1
            return None
        part = self._partial.get(key)
        if part is None:
            mine = [p for k, p in self._partial.items() if k[0] == sender]
            if len(mine) >= self.max_pending_per_sender:
                raise FrameError("memory", f"{h.describe()} from {sender!r}: the sender already "
                                           f"has {len(mine)} incomplete message(s), the limit")
            if total > self.max_bytes - self._reserved:
                raise FrameError("memory", f"{h.describe()} from {sender!r}: a {total}-byte "
                                           f"message does not fit: {self._reserved} of "
                                           f"{self.max_bytes} bytes already reserved by "
                                           f"{len(self._partial)} incomplete message(s)")
            held = sum(p.reserved for p in mine)
            if total > self.max_bytes_per_sender - held:
                raise FrameError("memory", f"{h.describe()} from {sender!r}: a {total}-byte "
                                           f"message does not fit: the sender already holds "
                                           f"{held} of its {self.max_bytes_per_sender}-byte "
                                           "limit")
            part = _Partial(h, recipient, total, now, total)
            self._partial[key] = part
            self._reserved += total
            self.peak_bytes = max(self.peak_bytes, self._reserved)
        else:
            first = part.header
            mismatch = [f"{name} {getattr(h, name)} vs {getattr(first, name)}"
                        for name in ("kind", "round", "chunk_count", "table_hash")
                        if getattr(h, name) != getattr(first, name)]
            if total != part.total:
                mismatch.append(f"total {total} vs {part.total}")
            if recipient != part.recipient:
                mismatch.append(f"recipient {recipient!r} vs {part.recipient!r}")
            if mismatch:
                raise FrameError("chunk", f"{h.describe()} from {sender!r} disagrees with "
                                          f"earlier chunks of its message: {', '.join(mismatch)}")
        if h.chunk_index in part.parts:
            self.stats["duplicates"] += 1
            return None
        if part.held + h.payload_len > part.total:
            raise FrameError("chunk", f"{h.describe()} from {sender!r}: its {h.payload_len} "
                                      f"bytes overlap earlier chunks: they would hold "
                                      f"{part.held + h.payload_len} bytes of a {part.total}-byte "
                                      "message")
        piece = mv[h.data_offset:]
        part.held += h.payload_len
        # keep a view into immutable bytes; copy what the caller may reuse
        part.parts[h.chunk_index] = (offset, piece if isinstance(data, bytes) else bytes(piece))
        self.stats["chunks"] += 1
        if len(part.parts) < h.chunk_count:
            return None

        del self._partial[key]
        self._reserved -= part.reserved
        self._mark_done(key)
        ordered = sorted(part.parts.values(), key=lambda p: p[0])
        at = 0
        for off, piece in ordered:
            if off != at:
                what = "gap" if off > at else "overlap"
                raise FrameError("chunk", f"{part.describe(sender)}: chunks do not tile it: "
                                          f"{what} at byte {min(at, off)}")
            at += len(piece)
        if at != part.total:
            raise FrameError("chunk", f"{part.describe(sender)}: chunks hold {at} bytes")
        whole = b"".join(piece for _, piece in ordered)
        inner = read_header(whole)
        if inner.is_chunk or (inner.message_id, inner.kind, inner.round) != \
                (h.message_id, h.kind, h.round):
            raise FrameError("chunk", f"{part.describe(sender)}: the reassembled frame is "
                                      f"{inner.describe()}, not the message its chunks announced")
        # All checks of a whole frame, its own body CRC included: the chunk CRCs prove the
        # bytes arrived as the sender chunked them, not that the frame inside is the one its
        # header describes, and a frame must be refused or accepted the same whichever way
        # it travelled (tests/test_fuzz.py's storms forge such frames). The second CRC pass
        # costs ~1.4 ms per 4 MB at this machine's 2.9 GB/s.
        frame = decode(whole, expect)
        if frame.sender != sender:
            raise FrameError("sender", f"{part.describe(sender)}: the reassembled frame names "
                                       f"sender {frame.sender!r}")
        self.stats["messages"] += 1
        return frame
