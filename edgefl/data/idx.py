"""Reads IDX files, the format MNIST and Fashion-MNIST ship in, plain or gzip-compressed.

An IDX file is a 4-byte magic number -- two zero bytes, a type code, the number of dimensions
-- then one big-endian uint32 per dimension, then the values, big-endian, row-major
(LeCun et al., "THE MNIST DATABASE", file-format section). edgefl reads local IDX files and
never downloads: a board may have no internet, and a run must not depend on a mirror.
"""
from __future__ import annotations

import gzip
import os
import struct
import zlib

import numpy as np

# type code (third magic byte) -> element dtype, all big-endian on disk
_DTYPES = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Return the array stored in the IDX file `path` (gzip is detected from the content).

    Raises FileNotFoundError if `path` does not exist and ValueError naming the file if the
    gzip stream is truncated or damaged, the header is malformed or the payload is shorter or
    longer than the header says.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(2)
        f.seek(0)
        if head != _GZIP_MAGIC:
            data = f.read()
        else:
            # a download cut short or damaged: gzip's EOFError / BadGzipFile / zlib.error name
            # no file (and EOFError is no ValueError, so it reached the CLI as a traceback)
            try:
                data = gzip.GzipFile(fileobj=f).read()
            except EOFError:
                raise ValueError(f"{path}: truncated gzip file (it ends before its compressed "
                                 f"data does); download or copy it again") from None
            except (gzip.BadGzipFile, zlib.error) as exc:
                raise ValueError(f"{path}: damaged gzip file ({exc}); download or copy it "
                                 f"again") from None
    return parse_idx(data, source=path)


def parse_idx(data: bytes, source: str = "<bytes>") -> np.ndarray:
    """Decode the bytes of one IDX file; `source` names it in error messages."""
    if len(data) < 4:
        raise ValueError(f"{source}: {len(data)} bytes is too short for an IDX header")
    zero, code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or code not in _DTYPES:
        raise ValueError(f"{source}: not an IDX file (magic number 0x{data[:4].hex()}; expected "
                         f"0x0000 then a type code in {sorted(hex(c) for c in _DTYPES)})")
    if ndim == 0:
        raise ValueError(f"{source}: IDX header declares 0 dimensions")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{source}: truncated IDX header ({len(data)} bytes, {ndim} dimensions "
                         f"need {header})")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    dtype = _DTYPES[code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) - header != expected:
        raise ValueError(f"{source}: IDX header says shape {shape} of {dtype.name} "
                         f"({expected} bytes) but the file holds {len(data) - header} bytes "
                         f"of data")
    values = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return values.astype(dtype.newbyteorder("="), copy=False)


def find_idx(directory: str | os.PathLike, stem: str) -> str | None:
    """Path of `stem` in `directory` under its usual spellings, or None.

    Accepts `train-images-idx3-ubyte`, `train-images-idx3-ubyte.gz` and the dotted
    `train-images.idx3-ubyte[.gz]` some mirrors use.
    """
    dotted = stem.replace("-idx", ".idx")
    for name in (stem, stem + ".gz", dotted, dotted + ".gz"):
        candidate = os.path.join(directory, name)
        if os.path.isfile(candidate):
            return candidate
    return None
