"""Decoded data sets kept on disk, so a run does not decode the same source twice.

Loading scikit-learn's digits means importing scikit-learn (about 1.4 s on a 2-core x86
machine, where the whole quickstart trains in 0.05 s); Fashion-MNIST means inflating 30 MB
of gzip. Both give the same arrays every time, so the first load writes them, still in their
stored units (a loader's `Raw`), to one uncompressed .npz in the user's cache directory, and
later loads read that instead:

    $EDGEFL_CACHE_DIR, else $XDG_CACHE_HOME/edgefl, else ~/.cache/edgefl

A cache file's name carries a key made of the loader's name, its options and the content
hash of each source file (and the cache format), so editing, replacing or upgrading a
source file (a new scikit-learn) makes a new key and a fresh decode; stale files
are not cleaned up (`rm -r ~/.cache/edgefl` is always safe). Files are written with
edgefl.io.atomic_write, so a crash leaves the old file or none; a file that is unreadable
anyway (a truncated copy, a disk error, another program's file of that name) is decoded again
and rewritten, with a warning, never an error. `EDGEFL_CACHE_DIR=off` turns caching off, and a
cache directory that cannot be written only costs the speed.

A process that has to decode holds an flock on the cache directory while it decodes and
writes (_Writing), so processes started together on a cold cache (`edgefl fleet up`, two
simulate runs) decode once: the others wait, then read the file. Under that lock the
temporary file of a writer that was killed (SIGKILL skips atomic_write's cleanup) is removed.

Hashing the sources is itself a tenth of a second for Fashion-MNIST, so a source's hash is
remembered (`source-hashes.json` in the cache directory) under its file's device, inode,
size, mtime and ctime, once the file has been left unchanged for a while (_SourceHashes says
why that is as safe as hashing it).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from typing import Callable, Sequence

import numpy as np

from ..io import atomic_write, lock_exclusive, temporary_target

log = logging.getLogger("edgefl.data.cache")

__all__ = ["CACHE_FORMAT", "SOURCE_HASHES", "cache_dir", "cache_path", "cached_raw",
           "register_kind"]

CACHE_FORMAT = 2          # bump when the file layout or a loader's output changes
# 2: IDX labels are checked as class labels (int8 -1 or float 1.5 are refused); an entry
#    decoded before that may hold them, and its key would still match
SOURCE_HASHES = "source-hashes.json"   # _SourceHashes' memo, beside the cache files
SETTLED_S = 2.0           # a source is remembered once unchanged this long (_SourceHashes)
WRITER_WAIT_S = 120.0     # the longest a load waits for another process's decode (_Writing)


def cache_dir() -> str | None:
    """The directory decoded data sets are kept in, or None when caching is off."""
    chosen = os.environ.get("EDGEFL_CACHE_DIR")
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "0", "off", "no", "none") else chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "edgefl")


def cache_path(name: str, sources: Sequence[str], options: dict | None = None) -> str | None:
    """Where the decoded `name` of these source files would be kept (None: caching off)."""
    directory = cache_dir()
    if directory is None:
        return None
    memo = _SourceHashes(directory)
    key = hashlib.sha256(json.dumps(
        [CACHE_FORMAT, name, options or {}, [memo.identity(s) for s in sources]],
        sort_keys=True).encode()).hexdigest()[:20]
    memo.save()
    return os.path.join(directory, f"{name}-{key}.npz")


def cached_raw(name: str, sources: Sequence[str], decode: Callable[[], object],
               options: dict | None = None):
    """decode()'s result (a loader's Raw), from the cache when a file for these sources is
    there, else decoded and then written to the cache. `sources`: the files decode() reads
    (their content hashes are in the key); `options`: anything else that changes its output.
    A result read from the cache is of decode()'s dataclass with `private` set: np.load made
    its arrays for it alone (see datasets.Raw)."""
    try:
        path = cache_path(name, sources, options)
    except OSError:             # a source vanished: let the loader say so in its own words
        return decode()
    if path is None:
        return decode()
    there = os.path.isfile(path)
    cached = _read_if_there(path, name)
    if cached is not None:
        return cached
    with _Writing(os.path.dirname(path)) as writing:
        if writing.waited or not there:    # another process may have written it meanwhile
            cached = _read_if_there(path, name)
            if cached is not None:
                return cached
        if writing.held:           # every writer holds the lock: a temporary file is orphaned
            writing.remove_orphans()
        raw = decode()
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_write(path, lambda f: _write(f, raw))
        except OSError as exc:
            log.info("data cache %s not written (%s); %s is decoded on every load", path, exc,
                     name)
    return raw


def _read_if_there(path: str, name: str):
    if not os.path.isfile(path):
        return None
    try:
        return _read(path)
    except Exception as exc:       # noqa: BLE001 - any unreadable file is rebuilt
        log.warning("data cache %s is unreadable (%s: %s); decoding %s again",
                    path, type(exc).__name__, exc, name)
    return None


class _Writing:
    """An exclusive flock on the cache directory itself (no lock file to list or clean up),
    held while a decoded data set is written. Waited for up to WRITER_WAIT_S (a stopped
    holder must not stall every launch); a directory that does not exist yet, cannot be
    opened or locked (a read-only board, some network file systems) is written without it,
    as before. The kernel lets go of a killed holder's lock."""

    def __init__(self, directory: str):
        self.directory, self.fd, self.held, self.waited = directory, None, False, False

    def __enter__(self) -> "_Writing":
        try:
            os.makedirs(self.directory, exist_ok=True)
            self.fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return self
        try:
            claim = lock_exclusive(self.fd, WRITER_WAIT_S)
        except OSError:            # no flock here: write as before, unlocked
            return self
        self.held, self.waited = claim in ("locked", "waited"), claim in ("waited", "busy")
        if claim == "busy":
            log.info("data cache %s: another process has been writing for over %.0f s; "
                     "decoding without waiting", self.directory, WRITER_WAIT_S)
        return self

    def remove_orphans(self) -> None:
        """The temporary data files (atomic_write's .<name>.npz.<random>.tmp, known by
        io.temporary_target) of writers that were killed before their cleanup ran: up to
        55 MB each, for good. (An edgefl
        from before this lock, writing into the same directory at this moment, loses its
        temporary file and only logs that its cache file was not written.)"""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            if not (temporary_target(name) or "").endswith(".npz"):
                continue       # not a data file's (the memo's writer does not take the lock)
            orphan = os.path.join(self.directory, name)
            try:
                os.unlink(orphan)
                log.info("data cache: removed %s, left by a writer that was killed", orphan)
            except OSError:
                pass

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)       # closing the descriptor lets go of the lock


def _identity(path: str) -> str:
    """The content hash of a source file: a file rewritten in place within the file
    system's timestamp granularity, or copied elsewhere, is still told apart (or matched)
    correctly. BLAKE2 reads Fashion-MNIST's 30 MB in about 40 ms, a tenth of decoding it."""
    digest = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class _SourceHashes:
    """The content hashes of source files, remembered in the cache directory (SOURCE_HASHES)
    by each file's (device, inode, size, mtime, ctime), so a launch does not read 30 MB to
    hash Fashion-MNIST again (0.1 s on a 2-core VM, a tenth of a 100-client run).

    Only a file that was last changed more than SETTLED_S before it was hashed, and whose
    stat did not change while it was hashed, is remembered: any later change to it sets its
    mtime and ctime (ctime cannot be set back) to a time after that, so a stamp that still
    matches means the content hashed. A file rewritten in place within the file system's
    timestamp granularity is therefore never remembered in that state, and is hashed each
    time, as before. An unreadable or foreign memo file is ignored and replaced."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, SOURCE_HASHES)
        self.changed = False
        try:
            with open(self.path, encoding="utf-8") as f:
                entries = json.load(f)
            self.entries = entries if isinstance(entries, dict) else {}
        except (OSError, ValueError):
            self.entries = {}

    @staticmethod
    def stamp(st: os.stat_result) -> list:
        return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]

    def identity(self, path: str) -> str:
        where = os.path.abspath(path)
        before = self.stamp(os.stat(path))
        known = self.entries.get(where)
        if isinstance(known, list) and len(known) == 6 and known[:5] == before:
            return known[5]
        digest = _identity(path)
        settled = time.time_ns() - max(before[3], before[4]) > SETTLED_S * 1e9
        if settled and self.stamp(os.stat(path)) == before:
            self.entries[where] = before + [digest]
            self.changed = True
        return digest

    def save(self) -> None:
        if not self.changed:
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            atomic_write(self.path, json.dumps(self.entries, sort_keys=True))
        except OSError as exc:        # a cache directory that cannot be written costs speed
            log.debug("source hashes not remembered in %s: %s", self.path, exc)


# The dataclass a cache file holds is named in it and found among these (the loaders' Raw),
# registered by the data module that defines it; the cache never imports its users.
_KINDS: dict = {}


def register_kind(kind: type) -> type:
    _KINDS[kind.__name__] = kind
    return kind


def _write(f, raw) -> None:
    arrays, fields = {}, {}
    for field in dataclasses.fields(raw):
        value = getattr(raw, field.name)
        if isinstance(value, np.ndarray):
            arrays[field.name] = value
        elif field.name != "private":
            fields[field.name] = value
    meta = {"format": CACHE_FORMAT, "kind": type(raw).__name__, "fields": fields,
            "arrays": sorted(arrays)}
    np.savez(f, _meta=np.array(json.dumps(meta, default=_plain)), **arrays)


def _plain(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not kept in a data cache")


def _read(path: str):
    with np.load(path, allow_pickle=False) as npz:
        meta = json.loads(str(npz["_meta"]))
        if meta.get("format") != CACHE_FORMAT:
            raise ValueError(f"cache format {meta.get('format')!r}, expected {CACHE_FORMAT}")
        kind = _KINDS.get(meta.get("kind"))
        if kind is None:
            raise ValueError(f"unknown kind {meta.get('kind')!r}")
        values = dict(meta["fields"])
        for key in meta["arrays"]:
            values[key] = npz[key]
    for field in dataclasses.fields(kind):
        if isinstance(values.get(field.name), list):     # JSON gave lists for tuples
            values[field.name] = tuple(values[field.name])
    for x, y in (("x_train", "y_train"), ("x_test", "y_test")):
        if x in values and y in values and len(values[x]) != len(values[y]):
            raise ValueError(f"{x} has {len(values[x])} samples, {y} {len(values[y])}")
    values["private"] = True
    return kind(**values)
