"""The frame format's fixed part, and what can be checked with a frame's bytes alone.

Here: the format's vocabulary and limits (magic, version, kinds, dtypes, flags; the sizes of
metadata and buffer names, the nesting of scalars), the two errors (FrameError for what is
received, EncodeError for what is refused on the way out), the CRC-32, and the 64-byte
header: packed by the writer, read and checked by read_header (docs/protocol.md sections 2
and 6, checks 1 to 8), with the body CRC (check 13) and verify(), which is both. Nothing here
knows what a receiver expects or parses metadata.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

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


def _check_body_crc(mv: memoryview, h: Header) -> None:
    computed = _crc32(mv[HEADER_SIZE:])
    if computed != h.crc:
        raise FrameError("crc", f"{h.describe()}: crc mismatch: header 0x{h.crc:08x}, computed "
                                f"0x{computed:08x} over bytes {HEADER_SIZE}..{len(mv) - 1} "
                                "(metadata + padding + payload)")
