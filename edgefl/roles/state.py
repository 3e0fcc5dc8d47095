"""What the roles keep on disk, written so that a crash at any instant leaves either the old
file or the new one, never a torn one (docs/reliability.md).

Every write goes to a temporary file in the same directory, is flushed and fsync'ed, renamed
over the target (atomic on POSIX), and then the directory itself is fsync'ed so the rename
survives a power cut. One file is the exception: a client's stored update frame, whose old
content is obsolete before the new is written, is overwritten in place (`overwrite_in_place`)
and checked by its own CRCs when read back. Arrays are stored as .npz with no pickles
(strings as NumPy unicode scalars, JSON for structure), so `np.load(path, allow_pickle=False)`
reads them.

    save_arrays(path, {"state.params": w}, {"round": 3})    # atomic npz: arrays + JSON meta
    arrays, meta = load_arrays(path)                       # StateError names file and cause
    append_journal(path, {"round": 3, "event": "aggregated"})   # one fsync'ed JSON line

`AggregatorCheckpoint` and `ClientProgress` are the two records the roles persist;
`hold_state_dir` keeps a second process of the same role off a state directory in use.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import zipfile
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from .. import io
from ..io import jsonable
from ..strategies import State
from ..transport import wire

__all__ = ["StateError", "StateWriteError", "atomic_write", "overwrite_in_place",
           "save_arrays", "load_arrays",
           "write_json", "read_json", "append_journal", "read_journal", "jsonable", "tag_floats",
           "untag_floats", "AggregatorCheckpoint", "hold_state_dir",
           "ClientProgress", "CHECKPOINT_FILE", "HISTORY_FILE", "JOURNAL_FILE", "PROGRESS_FILE",
           "UPLOAD_FILE"]

log = logging.getLogger("edgefl.roles.state")

CHECKPOINT_FILE = "aggregator.npz"
HISTORY_FILE = "history.jsonl"
JOURNAL_FILE = "rounds.jsonl"
PROGRESS_FILE = "client.npz"
UPLOAD_FILE = "update.frame"
_META_KEY = "__meta__"
# Every file a role keeps in its state directory is private to the service's account,
# whatever the umask: a board's stored update and progress can give its data away
# (gradient inversion), and the journals and locks keep them company (docs/security.md,
# "Data at rest"). Only the installed model (edgefl.infer) is written for others to read.
PRIVATE = 0o600


class StateError(ValueError):
    """A state file that cannot be read or does not belong to this run; the message names
    the file and the cause."""


class StateWriteError(OSError):
    """A state file that could not be written (disk full, quota, read-only file system, I/O
    error). The message names the file and the cause; the file's previous version is intact
    (atomic_write) or the journal is as it was (append_journal). `errno` is the cause's."""

    def __init__(self, message: str, errno_: int | None = None):
        super().__init__(message)
        self.errno = errno_


_WRITE_HINTS = {
    errno.ENOSPC: "the file system is full: free space there",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the file system is read-only",
}


def _write_failed(path: str, exc: OSError, what: str) -> StateWriteError:
    hint = _WRITE_HINTS.get(exc.errno)
    cause = exc.strerror or str(exc)
    return StateWriteError(f"{path}: cannot write {what} ({cause}"
                           f"{'; ' + hint if hint else ''})", exc.errno)


# ---------------------------------------------------------------------------------------
# atomic files
# ---------------------------------------------------------------------------------------

def atomic_write(path: str | os.PathLike, data) -> None:
    """edgefl.io.atomic_write into a directory made if missing, for the roles' state: the
    file is private to the service's account (0600), and a write that fails (a full disk:
    ENOSPC, at write, flush or fsync) raises StateWriteError naming the file and the cause;
    the old file is intact and no temporary file is left. `data` is bytes, or a callable
    that writes the content to the (binary) file object it is given."""
    path = os.fspath(path)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        io.atomic_write(path, data, mode=PRIVATE)
    except OSError as exc:
        what = "its new version" if callable(data) else f"its new version ({len(data)} bytes)"
        raise _write_failed(path, exc, f"{what}; the old one is intact") from exc


def overwrite_in_place(path: str | os.PathLike, data, what: str = "its new content") -> None:
    """Write `data` over the file at `path` where it stands (created if absent) and cut it
    to len(data), leaving it to the kernel to write back (within ~30 s on Linux): for a file
    whose old content is obsolete before this is called, and whose loss costs little. The
    content survives the process's death at once and a power cut once written back; a
    crash halfway leaves a torn file, which its reader must be able to tell (a frame's CRCs
    do).

    Why not atomic_write: a new file every time costs a fresh allocation of its pages and
    disk blocks, their release on unlink, and two journal commits (the file's and the
    directory's fsync). Rewriting the same file keeps its pages and blocks. For a client's
    4 MB update frame this measured 0.25 ms of CPU against 1.1-1.4 ms, and ten clients on
    one disk 5 ms less per round than the same rewrite with fdatasync. The directory is
    fsync'ed once, when the file is new."""
    path = os.fspath(path)
    view = memoryview(data).cast("B")
    try:
        created = not os.path.exists(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, PRIVATE)
    except OSError as exc:
        raise _write_failed(path, exc, what) from exc
    try:
        _narrow(fd)
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], done)
        if os.fstat(fd).st_size != len(view):
            os.ftruncate(fd, len(view))
    except OSError as exc:
        raise _write_failed(path, exc, f"{what} ({len(view)} bytes); the file may be torn, "
                                       "and its reader will say so") from exc
    finally:
        os.close(fd)
    if created:
        io.fsync_directory(os.path.dirname(os.path.abspath(path)))


def _narrow(fd: int) -> None:
    """A file written in place (not replaced) keeps the mode it was made with: one an older
    edgefl made 0644 is made PRIVATE as it is next written."""
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, PRIVATE)
    except OSError:        # not ours to change (another account's file we may write): as it is
        pass


_NONFINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


@contextlib.contextmanager
def hold_state_dir(directory: str | os.PathLike, role: str, files=(), subdirectories=()):
    """This process's claim on `directory` as `role`'s state directory, for as long as the
    block runs: a second process of that role there (a service and a hand-started copy, two
    boards' clients given one directory) is refused, naming the process that holds it. Two
    would overwrite each other's checkpoint, journal and records, and fight over the broker
    client id. The claim is an flock on `<directory>/<role>.lock`, which the kernel lets go
    when the holder dies however it dies (kill -9 included): a stale file never blocks.

    Once it holds the lock it removes the temporary files of the role's own writers that a
    kill mid-write left (_remove_orphans): those of `files`, the names the role replaces
    with atomic_write in `directory`, and any in `subdirectories`, which only this role
    writes (each role module's STATE_FILES and STATE_SUBDIRECTORIES)."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{role}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE)
    try:
        _narrow(fd)
        claim = io.lock_exclusive(fd)
        if claim == "busy":
            holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
            raise StateError(
                f"{directory}: the state directory is in use by another edgefl {role} "
                f"({holder or 'its process id not yet written'}; {path}): two would overwrite "
                f"each other's state; stop that one, or give this one a state_dir of its "
                f"own")
        if claim == "unsupported":
            log.warning("%s: this file system has no file locks; nothing stops a second "
                        "edgefl %s on this state directory", directory, role)
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"process {os.getpid()}\n".encode(), 0)
            _remove_orphans(directory, role, files, subdirectories)
        yield path
    finally:
        os.close(fd)          # (lets the lock go)


def _remove_orphans(directory: str, role: str, files, subdirectories) -> None:
    """Remove the temporary files of `role`'s writers in `directory` (hold_state_dir): a
    writer killed mid-write (kill -9, the OOM killer) leaves its hidden .<name>.<random>.tmp
    (0600, up to a model's size) there for good, since SIGKILL skips atomic_write's own
    clean-up. Safe only under the role's lock: every process that writes these files is
    that role's, which holds the lock while it runs, so none of them is alive to be writing
    one now. Only names the role's own writers give are touched: another role (which has a
    lock of its own and may share the directory) may be writing its files this moment."""
    own = frozenset(files)
    found = [os.path.join(directory, name) for name in os.listdir(directory)
             if io.temporary_target(name) in own]
    for sub in subdirectories:
        for where, dirs, names in os.walk(os.path.join(directory, sub)):
            found += [os.path.join(where, name) for name in names
                      if io.temporary_target(name) is not None]
    removed = 0
    for path in found:
        try:
            if os.path.isfile(path) and not os.path.islink(path):
                os.unlink(path)
                removed += 1
        except OSError:            # gone already, or not ours to remove: leave it
            pass
    if removed:
        log.info("%s: removed %d temporary file%s in %s left by writers killed mid-write",
                 role, removed, "" if removed == 1 else "s", directory)


def tag_floats(x):
    """JSON data that keeps non-finite floats: each becomes {"nonfinite": "nan" | "inf" |
    "-inf"} (JSON has no NaN), numpy scalars and arrays become Python values, tuples lists.
    `untag_floats` is the inverse, so strategy metadata and scalars survive a round trip
    bit for bit (Python's float repr round-trips exactly)."""
    return jsonable(x, _tag)


def _tag(value: float) -> dict:
    return {"nonfinite": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}


def untag_floats(x):
    if isinstance(x, dict):
        if len(x) == 1 and "nonfinite" in x and x["nonfinite"] in _NONFINITE:
            return _NONFINITE[x["nonfinite"]]
        return {k: untag_floats(v) for k, v in x.items()}
    if isinstance(x, list):
        return [untag_floats(v) for v in x]
    return x


def write_json(path, data) -> None:
    """A JSON state file (indented, a final newline), written by atomic_write."""
    atomic_write(path, (json.dumps(jsonable(data), indent=1) + "\n").encode("utf-8"))


def read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise StateError(f"{path}: unreadable JSON state file ({exc})") from None


def save_arrays(path, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
    """An .npz of `arrays` plus `meta` as JSON, written atomically."""
    if _META_KEY in arrays:
        raise ValueError(f"save_arrays: {_META_KEY!r} is reserved for the metadata")
    entries = {_META_KEY: np.array(json.dumps(jsonable(meta))),
               **{k: np.asarray(v) for k, v in arrays.items()}}
    # straight into the temporary file: an aggregator checkpoint holds the model (4 bytes a
    # parameter), and building it in a BytesIO first cost two more copies of it on the path
    # from a round's last update to the next announcement
    atomic_write(path, lambda f: np.savez(f, **entries))


def load_arrays(path) -> tuple[dict, dict]:
    """(arrays, meta) of a file written by save_arrays. FileNotFoundError if absent;
    StateError naming the file for anything unreadable."""
    path = os.fspath(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise StateError(f"{path}: unreadable state file ({type(exc).__name__}: {exc}); it was "
                         "not written by this edgefl, or the disk corrupted it") from None
    if _META_KEY not in arrays:
        raise StateError(f"{path}: not an edgefl state file (no {_META_KEY!r} entry)")
    try:
        meta = json.loads(str(arrays.pop(_META_KEY)))
    except ValueError as exc:
        raise StateError(f"{path}: metadata is not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise StateError(f"{path}: metadata is {type(meta).__name__}, not an object")
    return arrays, meta


def append_journal(path, record: Mapping) -> None:
    """Append one JSON line and fsync it: an append-only log that survives a crash (a torn
    last line, from a crash mid-write, is skipped by read_journal)."""
    line = (json.dumps(jsonable(record), separators=(",", ":")) + "\n").encode("utf-8")
    _append(path, line, "a journal record", "the journal")


def _append(path, data: bytes, what: str, whole: str) -> None:
    """Append `data` (whole lines) to `path` and fsync it; on a write error the file is cut
    back to its old size, so it still ends in a whole line. `what` and `whole` name the
    lines and the file in the error."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, PRIVATE)
    except OSError as exc:
        raise _write_failed(path, exc, what) from exc
    try:
        _narrow(fd)
        size = os.fstat(fd).st_size
        try:
            # A file that does not end in a newline ends in a line a power cut tore (a
            # process's own failed write is cut off below): end that line first, or the new
            # one is glued to it and lost to the reader with it.
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data
            view = memoryview(data)
            while view:                           # a full disk may take part of the line
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as exc:
            # Cut the torn line off: the next line appended would otherwise be glued to it
            # and both lost to the reader.
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass
            raise _write_failed(path, exc, f"{what}; {whole} is as it was") from exc
    finally:
        os.close(fd)


def read_journal(path) -> list[dict]:
    """The records of an append_journal file; [] if it does not exist."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            continue           # the torn tail of a crash mid-append
    return out


def _state_arrays(state: State | None, prefix: str) -> dict:
    return {} if state is None else {f"{prefix}{k}": v for k, v in state.buffers.items()}


def _state_from(arrays: dict, meta, prefix: str) -> State:
    buffers = {k[len(prefix):]: np.ascontiguousarray(v, dtype=np.float32)
               for k, v in arrays.items() if k.startswith(prefix)}
    return State(buffers, meta or {})


# ---------------------------------------------------------------------------------------
# the aggregator's checkpoint
# ---------------------------------------------------------------------------------------

@dataclass
class AggregatorCheckpoint:
    """Everything the aggregator needs to continue after a crash, saved after every round.

    run_id:      a random id made when the run started, kept across restarts; clients key
                 their own state by it (a new run resets them).
    fingerprint: what the run is (config, federation, client ids): a restart with another
                 config is refused instead of mixing two runs in one state directory.
    round:       the last aggregated round (0 before round 1).
    aggregated:  the rounds aggregated so far, in order, each once.
    state:       the strategy's server State (global model, momentum, FedMR's model list,
                 FedVeca's tau table, ... and the setup it was initialised with).
    strategy:    name and hyper-parameters as used (DUW with its learned table), so a
                 restart does not redo an offline phase.
    rng:         the run seed. Every random choice is a pure function of (seed, round[,
                 client]) -- selection, local data order, FedMR's permutations -- so the
                 seed and `round` are the whole RNG state.
    history:     the per-round metrics records so far (metrics.jsonl is rewritten from it).
                 Kept beside the checkpoint in HISTORY_FILE, appended to (_write_history):
                 only the last record may still change between two saves (its evaluation,
                 made in the background, comes in), every earlier one is final.
    elapsed_s:   wall time spent in rounds so far (the clock of `elapsed_s` in records).
    """
    run_id: str
    fingerprint: str
    round: int
    aggregated: list
    state: State
    strategy: dict
    rng: dict
    history: list = field(default_factory=list)
    elapsed_s: float = 0.0

    def save(self, directory) -> str:
        directory = os.fspath(directory)
        path = os.path.join(directory, CHECKPOINT_FILE)
        meta = {"format": "edgefl-aggregator-checkpoint", "version": 2, "run_id": self.run_id,
                "fingerprint": self.fingerprint, "round": self.round,
                "aggregated": list(self.aggregated),
                "state_meta": tag_floats(dict(self.state.meta)),
                "strategy": tag_floats(self.strategy), "rng": self.rng,
                "history_len": len(self.history), "elapsed_s": self.elapsed_s}
        try:
            # the history's new lines first: a crash before the rename leaves lines past
            # history_len, which load ignores and the round's rerun supersedes
            _write_history(directory, self.history)
            save_arrays(path, _state_arrays(self.state, "state."), meta)
        except StateWriteError as exc:
            raise StateWriteError(f"checkpoint of round {self.round} not saved: {exc}; a "
                                  "restart resumes from the checkpoint that is there",
                                  exc.errno) from exc
        return path

    @classmethod
    def load(cls, directory) -> "AggregatorCheckpoint | None":
        """The checkpoint in `directory`, or None if there is none."""
        path = os.path.join(os.fspath(directory), CHECKPOINT_FILE)
        try:
            arrays, meta = load_arrays(path)
        except FileNotFoundError:
            return None
        if meta.get("format") != "edgefl-aggregator-checkpoint" or \
                meta.get("version") not in (1, 2):
            raise StateError(f"{path}: not an edgefl aggregator checkpoint of version 1 or 2 "
                             f"(format {meta.get('format')!r}, version {meta.get('version')!r})")
        try:
            # version 1 (before 2026-11-29) held the history itself; the next save moves it
            history = list(meta.get("history", [])) if meta["version"] == 1 else \
                _read_history(os.fspath(directory), int(meta["history_len"]))
            aggregated = [int(r) for r in meta["aggregated"]]
            return cls(run_id=str(meta["run_id"]), fingerprint=str(meta["fingerprint"]),
                       round=int(meta["round"]), aggregated=aggregated,
                       state=_state_from(arrays, untag_floats(meta["state_meta"]), "state."),
                       strategy=untag_floats(dict(meta["strategy"])), rng=dict(meta["rng"]),
                       history=history,
                       elapsed_s=float(meta.get("elapsed_s", 0.0)))
        except StateError:
            raise                  # the history file's, naming it
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(f"{path}: incomplete checkpoint ({type(exc).__name__}: {exc})") \
                from None


class _HistoryWritten:
    """What this process last wrote to one directory's HISTORY_FILE: its first `count`
    records, the last of them the object `last` as encoded in `last_line`."""
    __slots__ = ("count", "last", "last_line")

    def __init__(self, count: int, last, last_line: str):
        self.count, self.last, self.last_line = count, last, last_line


# by the state directory's absolute path (one aggregator writes a directory at a time)
_HISTORY_WRITTEN: dict[str, _HistoryWritten] = {}


def _history_line(i: int, record) -> str:
    return json.dumps({"i": i, "record": jsonable(record)}, separators=(",", ":")) + "\n"


def _write_history(directory: str, history: list) -> None:
    """Bring `directory`'s HISTORY_FILE up to `history`: append the records not written
    yet, and the last written one again if it changed since (its evaluation came in); the
    last line of an index wins. Version 1 checkpoints held the whole history in their JSON
    and encoded it at every save, which at 1,000 rounds was about 17 ms of CPU a round
    (tools/bench_checkpoint.py, docs/scaling.md); this is the same few lines at any round.
    The first save of a process, or of a history that is not the one written last (another
    run, a restart), rewrites the file whole and atomically, which also drops a torn last
    line. A failed write leaves the memory of what was written as it was, so the next save
    writes the same lines again."""
    path = os.path.join(directory, HISTORY_FILE)
    key = os.path.abspath(directory)
    done = _HISTORY_WRITTEN.get(key)
    if done is None or done.count > len(history) or \
            (done.count and history[done.count - 1] is not done.last):
        lines = [_history_line(i, record) for i, record in enumerate(history)]
        atomic_write(path, "".join(lines).encode("utf-8"))
        last_line = lines[-1] if lines else ""
    else:
        lines = []
        if done.count:
            again = _history_line(done.count - 1, done.last)
            if again != done.last_line:
                lines.append(again)
        lines += [_history_line(i, history[i]) for i in range(done.count, len(history))]
        if lines:
            _append(path, "".join(lines).encode("utf-8"), "history records", "the history file")
        last_line = lines[-1] if lines else done.last_line
    _HISTORY_WRITTEN[key] = _HistoryWritten(len(history), history[-1] if history else None,
                                            last_line)


def _read_history(directory: str, count: int) -> list:
    """The first `count` records of `directory`'s HISTORY_FILE, the last line of each index
    winning; lines past `count` (a save the crash interrupted) and a torn last line are
    ignored. StateError naming the file when a record is missing."""
    path = os.path.join(directory, HISTORY_FILE)
    if count == 0:
        return []
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise StateError(f"{path}: missing; the checkpoint beside it lists {count} round "
                         f"record(s) kept in it (copy the state directory whole)") from None
    except (OSError, ValueError) as exc:
        raise StateError(f"{path}: unreadable history ({exc})") from None
    found: dict[int, Any] = {}
    for line in text.split("\n"):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            i = entry["i"]
            if type(i) is int and 0 <= i < count:
                found[i] = entry["record"]
        except (ValueError, TypeError, KeyError):
            continue               # a torn line, from a crash mid-append
    missing = [i for i in range(count) if i not in found]
    if missing:
        raise StateError(f"{path}: holds no record for {len(missing)} of the {count} entries "
                         f"the checkpoint lists (the first: entry {missing[0]}); the file is "
                         f"not this checkpoint's, or the disk lost part of it")
    return [found[i] for i in range(count)]


def _stored_frame_problem(data: bytes, round_: int, size) -> str | None:
    """None when `data` is the whole, intact update frame of round `round_` (`size` bytes),
    else what is wrong with it."""
    if len(data) != size:
        return f"{len(data)} bytes, the progress file says {size}: torn"
    try:
        h = wire.verify(data)
    except wire.FrameError as exc:
        return f"torn: {exc.reason}"
    if h.is_chunk or h.kind != "update" or h.round != round_:
        return f"holds {h.describe()}, not the update of round {round_}"
    return None


# ---------------------------------------------------------------------------------------
# a client's progress
# ---------------------------------------------------------------------------------------

@dataclass
class ClientProgress:
    """What a client persists after each local round, before it uploads.

    run_id:        the run this progress belongs to (a new run id resets it).
    trained:       the last round trained (0: none). A round is never trained twice: an
                   announcement of this round again (the aggregator restarted) re-sends
                   `upload` instead.
    upload:        the encoded update frame of round `trained` (None when the task did not
                   allow an upload), kept to be re-sent byte for byte when the round is
                   announced again (the aggregator restarted and lost what it had received)
                   or this client restarted (its last publish may not have reached the
                   broker); the aggregator ignores a copy it already has. Stored in a file
                   of its own, UPLOAD_FILE, rewritten in place every round (`save_upload`):
                   once save() has recorded round `trained`, the previous round's frame is
                   of no use. It is left to the kernel to write back (not fsync'ed): it
                   survives the process's death at once, a power cut within ~30 s. If the
                   process ended before that file was written, or while it was, or the
                   power went before it reached the disk (a torn or older frame: load()
                   checks the frame's CRCs, round and size), load() says so in
                   `upload_missing` and the round cannot be re-sent (it is still not trained
                   again).
    client_state:  the strategy's client State (MFL none, FedUmf's stored update g, ...).
    """
    run_id: str | None = None
    trained: int = 0
    upload: bytes | None = None
    client_state: State | None = None
    upload_missing: str | None = None     # load(): the update file not written, and why

    def save(self, directory) -> str:
        """Write the progress file: round, client state, and the name of the update file,
        which `save_upload` writes. A client calls save() before it uploads (so a round is
        never trained twice) and save_upload() while the upload goes out (the 4 bytes per
        parameter of the frame stay off the path from training to the aggregator)."""
        directory = os.fspath(directory)
        path = os.path.join(directory, PROGRESS_FILE)
        meta = {"format": "edgefl-client-progress", "version": 1, "run_id": self.run_id,
                "trained": self.trained, "upload_file": self.upload_file,
                "upload_bytes": None if self.upload is None else len(self.upload),
                "has_client_state": self.client_state is not None,
                "client_state_meta": tag_floats(dict(self.client_state.meta))
                if self.client_state is not None else None}
        save_arrays(path, _state_arrays(self.client_state, "client_state."), meta)
        return path

    @property
    def upload_file(self) -> str | None:
        return None if self.upload is None else UPLOAD_FILE

    def save_upload(self, directory) -> None:
        """Write the update frame over UPLOAD_FILE, in place (overwrite_in_place: call it
        after save(), which makes the old frame obsolete), then delete the update-<round>.frame
        files that earlier versions wrote, one per round."""
        directory = os.fspath(directory)
        if self.upload is not None:
            # Not flushed: a lost copy costs one re-send, never a second training (save() is
            # durable), and load() tells a torn or stale one. Forcing 4 bytes per parameter
            # to flash every round would cost a board's SD card that much wear and the round
            # a synchronous flush.
            overwrite_in_place(os.path.join(directory, UPLOAD_FILE), self.upload,
                               f"the update frame of round {self.trained}")
        for name in os.listdir(directory):
            if name.startswith("update-") and name.endswith(".frame"):
                try:
                    os.unlink(os.path.join(directory, name))
                except OSError:
                    pass

    @classmethod
    def load(cls, directory) -> "ClientProgress":
        """The persisted progress in `directory`, or a fresh one if there is none."""
        directory = os.fspath(directory)
        path = os.path.join(directory, PROGRESS_FILE)
        try:
            arrays, meta = load_arrays(path)
        except FileNotFoundError:
            return cls()
        if meta.get("format") != "edgefl-client-progress" or meta.get("version") != 1:
            raise StateError(f"{path}: not an edgefl client progress file of version 1")
        try:
            upload, missing = None, None
            if meta["upload_file"] is not None:
                upload_path = os.path.join(directory, meta["upload_file"])
                try:
                    with open(upload_path, "rb") as f:
                        upload = f.read()
                except FileNotFoundError:
                    missing = upload_path      # the process ended before it was written
                except OSError as exc:
                    raise StateError(f"{path}: its stored update {upload_path} is unreadable "
                                     f"({exc.strerror or exc})") from None
                if upload is not None:
                    # rewritten in place: a crash while it was written leaves it torn, or
                    # still holding an older round's frame
                    torn = _stored_frame_problem(upload, int(meta["trained"]),
                                                 meta["upload_bytes"])
                    if torn is not None:
                        upload, missing = None, f"{upload_path} ({torn})"
            state = _state_from(arrays, untag_floats(meta["client_state_meta"]),
                                "client_state.") \
                if meta["has_client_state"] else None
            return cls(run_id=meta["run_id"], trained=int(meta["trained"]), upload=upload,
                       client_state=state, upload_missing=missing)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, StateError):
                raise
            raise StateError(f"{path}: incomplete progress file ({type(exc).__name__}: "
                             f"{exc})") from None
