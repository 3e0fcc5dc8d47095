"""Files that a crash or a power cut leaves whole, and JSON that any reader can parse.

`atomic_write` is the one way edgefl replaces a file (state, checkpoints, models, outputs,
installed units): a temporary file in the target's directory, written, flushed and fsync'ed,
renamed over the target (atomic on POSIX), then the directory fsync'ed so the rename itself
survives a power cut (boards lose power). A reader sees the old file or the new one, never a
part; a write that fails leaves the old file as it was and no temporary file behind.
`atomic_write_all` replaces files that belong together (a private key and its .pub): all
are written before any is renamed.

`lock_exclusive` is the one way a process claims a file or directory against other
processes (a role's state directory, the data cache's writer): an flock, which the kernel
lets go when the holder dies, however it dies. `temporary_target` tells atomic_write's
temporary files by their names (`temporary_path` makes one, for a writer that builds a file
in place), for the holder of a directory to remove those a writer killed mid-write left
there (SIGKILL skips the writer's own clean-up).

`jsonable` is the one conversion to plain JSON types: NumPy scalars and arrays become
Python numbers and lists, tuples lists, mapping keys strings, and NaN/inf null (JSON has no
NaN). `write_json` is the two together.

`terminal_text` is the one way text another node chose reaches an operator's terminal or
log (`edgefl status`, `edgefl ctl`, the aggregator's log): control characters (escape
sequences that retitle, clear or recolour the terminal, a bell, a carriage return) and
invisible format characters (a right-to-left override) become their escapes, \\x1b,
\\u202e, so the operator sees what was sent and the terminal obeys none of it.

    atomic_write(path, b"...")                     # bytes; str is written as UTF-8
    atomic_write(path, lambda f: np.savez(f, **arrays))   # or streamed to the temporary file
    write_json(path, {"accuracy": np.float32(0.9), "loss": float("nan")})  # loss: null
"""
from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import tempfile
import time
import unicodedata
from collections.abc import Mapping
from typing import Callable, Iterable, Union

import numpy as np

__all__ = ["atomic_write", "atomic_write_all", "bounded_text", "fsync_directory", "jsonable",
           "lock_exclusive", "replace_atomic", "temporary_path",
           "temporary_target", "terminal_text", "write_json"]

Content = Union[bytes, bytearray, memoryview, str, Callable]


def atomic_write(path: str | os.PathLike, data: Content, *, mode: int = 0o644) -> None:
    """Replace `path` with `data`: bytes, str (written as UTF-8), or a callable that writes
    the content to the binary file object it is given (a large file need not be built in
    memory first). `mode`: the new file's permission bits, whatever the umask. The parent
    directory must exist. An OSError on the way (a full disk at write, flush or fsync; no
    permission) propagates with the old file intact and the temporary file removed; one that
    stops the temporary file being made (no such directory, no permission) names `path` and
    its directory."""
    atomic_write_all([(path, data, mode)])


def atomic_write_all(files: Iterable[tuple[str | os.PathLike, Content, int]]) -> None:
    """atomic_write for files that belong together, (path, data, mode) each: every one is
    written whole under its temporary name before any is renamed, in the order given, so a
    failure while writing (a full disk, no permission, no such directory) leaves all the old
    files as they were. Only a rename failing part-way (rare: each temporary file is already
    in its target's directory) leaves the earlier ones replaced."""
    staged = []          # (temporary, path), written and fsync'ed, not yet renamed
    try:
        for path, data, mode in files:
            path = os.fspath(path)
            staged.append((_write_temporary(path, data, mode), path))
        directories = []
        while staged:
            tmp, path = staged[0]
            os.replace(tmp, path)
            del staged[0]
            directory = os.path.dirname(os.path.abspath(path))
            if directory not in directories:
                directories.append(directory)
    except BaseException:
        for tmp, _ in staged:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise
    for directory in directories:
        fsync_directory(directory)


def _write_temporary(path: str, data: Content, mode: int) -> str:
    """A temporary file beside `path` holding `data`, flushed and fsync'ed (none left behind
    when that fails)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    fd, tmp = _make_temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(fd, mode)
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return tmp


def _make_temporary(path: str) -> tuple[int, str]:
    """(fd, name) of a new empty file (0600) beside `path`, named as temporary_target
    recognises."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        return tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                dir=directory)
    except OSError as exc:
        # mkstemp's own message names the temporary file, which the caller never asked
        # for: name the file asked for and the directory that refused it
        raise type(exc)(exc.errno, f"cannot write {path}: {exc.strerror}: {directory}") \
            from None


def temporary_path(path: str | os.PathLike) -> str:
    """A new empty file (0600) beside `path` under the name atomic_write gives its temporary
    files, for a writer that builds a file in place (the ONNX exporter, whose tools write
    to a path) before replace_atomic: the holder of the directory knows it by that name
    (temporary_target) and removes it when a kill left it. The writer removes it when done
    or failed."""
    fd, tmp = _make_temporary(os.fspath(path))
    os.close(fd)
    return tmp


# the name _make_temporary's mkstemp gives: "." + the target's name + "." + mkstemp's random
# part (8 characters of [a-z0-9_], CPython's tempfile) + ".tmp"; tests/test_io.py checks a
# real atomic_write's temporary file against it
_TEMPORARY_NAME = re.compile(r"\.(.+)\.[a-z0-9_]{8}\.tmp\Z")


def temporary_target(name: str) -> str | None:
    """The name of the file an atomic_write temporary file named `name` (a base name) was to
    replace, or None when `name` is not such a file."""
    match = _TEMPORARY_NAME.match(name)
    return match.group(1) if match else None


def replace_atomic(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename `src`, a file already written and fsync'ed in dst's directory, over `dst`, then
    fsync the directory: the last step of atomic_write, for a file built in place under a
    temporary name (an ONNX export measured before it replaces the served model)."""
    dst = os.fspath(dst)
    os.replace(os.fspath(src), dst)
    fsync_directory(os.path.dirname(os.path.abspath(dst)))


def fsync_directory(directory: str | os.PathLike) -> None:
    """Make a rename or a new file in `directory` durable. Best effort: a platform or file
    system without directory fds or their fsync still renamed atomically."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def lock_exclusive(fd: int, wait_s: float = 0.0, poll_s: float = 0.05) -> str:
    """An exclusive flock on the open file or directory `fd`, waiting up to `wait_s` for
    another process to let go. Returns "locked" (at once), "waited" (locked after waiting),
    "busy" (still held by another process after wait_s) or "unsupported" (a file system
    without flock, some network ones: the caller goes on unlocked, as before locks were)."""
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return "waited" if waited else "locked"
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return "busy"
            waited = True
            time.sleep(poll_s)
        except OSError as exc:
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return "unsupported"
            raise


def jsonable(x, nonfinite=None):
    """`x` in plain JSON types: mappings with string keys, lists (from tuples and arrays),
    Python scalars (from NumPy's). JSON has no NaN or infinity: each non-finite float becomes
    None, or `nonfinite(value)` when given (roles.state.tag_floats keeps them that way)."""
    # Plain dicts, lists and scalars first, by exact type: the aggregator's checkpoint passes
    # its whole history through here every round, and the generic isinstance checks against
    # Mapping (an ABC) cost more than the JSON encoding itself (docs/scaling.md, third pass).
    t = type(x)
    if t in _AS_IS:
        return x
    if t is float:
        return x if math.isfinite(x) else (None if nonfinite is None else nonfinite(x))
    if t is dict:
        return {(k if type(k) is str else str(k)):
                (v if type(v) in _AS_IS else jsonable(v, nonfinite)) for k, v in x.items()}
    if t is list or t is tuple:
        return [v if type(v) in _AS_IS else jsonable(v, nonfinite) for v in x]
    if isinstance(x, Mapping):
        return {str(k): jsonable(v, nonfinite) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v, nonfinite) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist(), nonfinite)
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None if nonfinite is None else nonfinite(x)
    return x


# returned as they are (exact types: a str or int subclass goes the generic way, as before)
_AS_IS = frozenset({str, int, bool, type(None)})


def write_json(path: str | os.PathLike, data, *, indent: int | None = 1,
               mode: int = 0o644) -> None:
    """`jsonable(data)` as a JSON document with a final newline, written by atomic_write."""
    atomic_write(path, json.dumps(jsonable(data), indent=indent) + "\n", mode=mode)


def bounded_text(value, limit: int | None) -> str:
    """str(value), at most `limit` characters (None: all) and the rest said as a count, so a
    reader sees that it was cut and by how much; otherwise as it is (terminal_text escapes it
    for display; an event carries it raw, and its readers escape it)."""
    text = str(value)
    if limit is not None and len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    return text


def terminal_text(value, limit: int | None = None, *, one_line: bool = False) -> str:
    """str(value) safe to print on a terminal: every control (Cc) or format (Cf) character
    but tab and newline, and every lone surrogate (Cs: JSON's "\\ud800", which no terminal
    encoding can print), as its Python escape; at most `limit` characters, the rest said as
    a count. one_line: tab and newline escaped too, for a log line a sender must not be able
    to end and follow with lines of its own."""
    text = bounded_text(value, limit)
    if text.isprintable():
        return text
    kept = "" if one_line else "\t\n"
    return "".join(ch if ch in kept or unicodedata.category(ch) not in ("Cc", "Cf", "Cs")
                   else ascii(ch)[1:-1] for ch in text)
