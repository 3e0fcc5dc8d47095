"""What a receiver accepts: the Expectation, and the checks of a received frame's fields.

The Expectation a receiver states (kinds, rounds, senders, the topic's parties, dtypes, the
model's layer table) and the header checks against it (docs/protocol.md section 6, checks 9
to 12); the metadata: parsed with one strict JSON decoder (never pickle, never eval) and
checked key by key, the sender and recipient against the topic, scalars as plain JSON
values, buffer rows against the payload and the table, int8 scales (checks 14 to 16); and
the finite-value check with the layer it names (check 17). Every failure is a FrameError
whose code names the check; decode() and the Reassembler run them in that order.
"""
from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import kernels
from ...params import LayerTable
from ..topics import TopicError, validate_id
from .header import (ALIGN, BLOB_KINDS, DTYPES, HEADER_SIZE, ITEMSIZE, KINDS, MAX_JSON_DEPTH,
                     MAX_NAME_CHARS, TENSOR_KINDS, EncodeError, FrameError, Header)

_F32_MAX = float(np.finfo(np.float32).max)


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


def _json_value(v, path, depth: int = 0, err=EncodeError):
    """v as plain JSON data (numpy scalars unwrapped), or err naming the path. `path`: the
    value's name, a string or (the parent's path, a key or index), spelled out only for an
    error. Every frame's scalars pass through here twice (encoded, then decoded), so the
    exact JSON types are taken first, before the isinstance checks (numpy scalars, int and
    float subclasses, other sequences and mappings)."""
    if depth > MAX_JSON_DEPTH:
        raise err(f"{_spell(path)}: nested deeper than {MAX_JSON_DEPTH} levels")
    t = type(v)
    if t is str or t is bool or t is int or v is None:
        return v
    if t is float:
        if not math.isfinite(v):
            raise err(f"{_spell(path)} is {v}: JSON metadata carries finite numbers only "
                      "(send None for 'no value')")
        return v
    if t is dict:
        out = {}
        for k, x in v.items():
            if type(k) is not str and not isinstance(k, str):
                raise err(f"{_spell(path)}: key {k!r} is not a string")
            out[k] = _json_value(x, (path, k), depth + 1, err)
        return out
    if isinstance(v, np.generic):
        v = v.item()
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return _json_value(float(v), path, depth, err)
    if isinstance(v, (list, tuple)):
        return [_json_value(x, (path, i), depth + 1, err) for i, x in enumerate(v)]
    if isinstance(v, Mapping):
        return _json_value(dict(v), path, depth, err)
    raise err(f"{_spell(path)}: {type(v).__name__} is not a JSON value (numbers, strings, "
              "bools, None, lists, dicts)")


def _spell(path) -> str:
    """A _json_value path as the error names it: scalars.a[2].b."""
    if isinstance(path, str):
        return path
    parent, key = path
    return f"{_spell(parent)}[{key}]" if isinstance(key, int) else f"{_spell(parent)}.{key}"


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
