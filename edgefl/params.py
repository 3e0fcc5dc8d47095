"""LayerTable: named, shaped slices of ONE contiguous float32 parameter buffer.

Aggregation, recombination (FedMR), momentum (MFL), stored updates (FedUmf) and wire payloads
all work on whole flat buffers; a layer is only ever a view into one. Extra per-model state
(momentum, gradient sums) is another buffer with the same table. The table's digest travels
with every buffer on the wire, so a model and a buffer from a different architecture are
never mixed silently.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from math import prod
from typing import Iterable, Mapping

import numpy as np

from .errors import KernelError


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple
    offset: int

    @property
    def size(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class LayerTable:
    """Immutable (name, shape, offset) entries plus a content hash of exactly those."""

    entries: tuple
    size: int = field(init=False)
    digest: str = field(init=False)

    def __post_init__(self):
        entries = tuple(Entry(str(n), tuple(int(d) for d in s), int(o)) for n, s, o in
                        ((e.name, e.shape, e.offset) if isinstance(e, Entry) else e
                         for e in self.entries))
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise KernelError(f"LayerTable: duplicate layer names in {names}")
        expected = 0
        for e in entries:
            if e.offset != expected:
                raise KernelError(f"LayerTable: {e.name!r} starts at {e.offset}, expected {expected} "
                                  "(entries must be contiguous and in order)")
            if any(d <= 0 for d in e.shape):
                raise KernelError(f"LayerTable: {e.name!r} has an empty shape {e.shape}")
            expected += e.size
        object.__setattr__(self, "entries", entries)
        object.__setattr__(self, "size", expected)
        canon = json.dumps([[e.name, list(e.shape), e.offset] for e in entries],
                           separators=(",", ":"))
        object.__setattr__(self, "digest", hashlib.sha256(canon.encode()).hexdigest())

    @classmethod
    def from_shapes(cls, shapes: Iterable) -> "LayerTable":
        """Build from (name, shape) pairs laid out back to back."""
        entries, off = [], 0
        for name, shape in shapes:
            entries.append(Entry(name, tuple(shape), off))
            off += prod(shape)
        return cls(tuple(entries))

    @property
    def hash64(self) -> int:
        """First 8 bytes of the digest, as carried in wire frame headers."""
        return int(self.digest[:16], 16)

    @property
    def names(self) -> tuple:
        return tuple(e.name for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, name: str) -> Entry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KernelError(f"no layer {name!r}; layers are {list(self.names)}")

    def segment_offsets(self) -> np.ndarray:
        """Start of every entry plus the end: the per-layer segments int8 codecs use."""
        return np.array([e.offset for e in self.entries] + [self.size], dtype=np.int64)

    # -------------------------------------------------------------------- buffers
    def zeros(self) -> np.ndarray:
        return np.zeros(self.size, dtype=np.float32)

    def check(self, buf, what: str = "buffer") -> np.ndarray:
        """Return buf if it is a contiguous float32 vector of this table's size."""
        if not isinstance(buf, np.ndarray) or buf.dtype != np.float32:
            got = buf.dtype if isinstance(buf, np.ndarray) else type(buf).__name__
            raise KernelError(f"{what}: need a float32 array, got {got}")
        if buf.ndim != 1 or buf.size != self.size:
            raise KernelError(f"{what}: shape {buf.shape} does not match the layer table "
                              f"({self.size} parameters in {len(self)} layers)")
        if not buf.flags.c_contiguous:
            raise KernelError(f"{what}: not contiguous")
        return buf

    def view(self, buf: np.ndarray, name: str) -> np.ndarray:
        """The layer `name` of buf, shaped; a view, never a copy."""
        e = self[name]
        return self.check(buf)[e.offset:e.offset + e.size].reshape(e.shape)

    def views(self, buf: np.ndarray) -> dict:
        self.check(buf)
        return {e.name: buf[e.offset:e.offset + e.size].reshape(e.shape) for e in self.entries}

    def pack(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        """One flat buffer from per-layer arrays (copies; used for imports and tests)."""
        missing = [n for n in self.names if n not in arrays]
        extra = [n for n in arrays if n not in self.names]
        if missing or extra:
            raise KernelError(f"pack: missing layers {missing}, unknown layers {extra}")
        buf = self.zeros()
        for e in self.entries:
            a = np.asarray(arrays[e.name], dtype=np.float32)
            if a.shape != e.shape:
                raise KernelError(f"pack: layer {e.name!r} has shape {a.shape}, table says {e.shape}")
            buf[e.offset:e.offset + e.size] = a.reshape(-1)
        return buf

    def to_json(self) -> list:
        return [[e.name, list(e.shape), e.offset] for e in self.entries]

    @classmethod
    def from_json(cls, rows) -> "LayerTable":
        try:
            return cls(tuple(Entry(str(n), tuple(s), int(o)) for n, s, o in rows))
        except (TypeError, ValueError) as exc:
            raise KernelError(f"LayerTable.from_json: malformed rows ({exc})") from exc

    def require_same(self, other: "LayerTable", what: str = "buffer") -> None:
        if other.digest != self.digest:
            raise KernelError(f"{what}: layer table {other.digest[:12]} does not match the model's "
                              f"{self.digest[:12]} ({len(other)} vs {len(self)} layers, "
                              f"{other.size} vs {self.size} parameters)")
