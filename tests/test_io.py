"""edgefl.io: the one atomic write (the file and then its directory fsync'ed, the old file
intact and no temporary left when a write fails, the permission bits asked for) and the one
JSON sanitiser."""
from __future__ import annotations

import errno
import json
import math
import os
import stat

import numpy as np
import pytest

from edgefl import io


def test_atomic_write_fsyncs_the_file_then_its_directory(tmp_path, fsynced):
    path = tmp_path / "model.onnx"
    io.atomic_write(path, b"new bytes")
    assert path.read_bytes() == b"new bytes"
    assert len(fsynced) == 2
    temporary, directory = fsynced
    assert os.path.dirname(temporary) == str(tmp_path)          # written beside the target
    assert os.path.basename(temporary).startswith(".model.onnx.")
    assert temporary.endswith(".tmp") and directory == str(tmp_path)
    assert os.listdir(tmp_path) == ["model.onnx"]


@pytest.mark.parametrize("data, expected", [
    (b"bytes", b"bytes"),
    ("text: \u00e9\n", "text: \u00e9\n".encode("utf-8")),           # str is written as UTF-8
    (lambda f: f.write(b"streamed"), b"streamed"),
    (memoryview(b"a view"), b"a view"),
])
def test_atomic_write_takes_bytes_text_or_a_writer(tmp_path, data, expected):
    path = tmp_path / "f"
    path.write_bytes(b"old")
    io.atomic_write(path, data)
    assert path.read_bytes() == expected


def test_atomic_write_sets_the_mode_asked_for(tmp_path):
    old = os.umask(0o077)           # the mode is the one asked for, whatever the umask
    try:
        io.atomic_write(tmp_path / "unit", "x", mode=0o644)
        io.atomic_write(tmp_path / "secret", "x", mode=0o600)
        io.atomic_write(tmp_path / "default", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "unit").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "secret").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "default").st_mode) == 0o644


@pytest.mark.parametrize("where", ["write", "fsync", "replace"])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, where):
    path = tmp_path / "state.json"
    path.write_text("old")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "write":
        data = lambda f: (f.write(b"half"), full())             # noqa: E731
    else:
        data = b"new"
        monkeypatch.setattr(os, where, full)
    with pytest.raises(OSError) as info:
        io.atomic_write(path, data)
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["state.json"]


def test_a_write_interrupted_by_any_exception_leaves_no_temporary(tmp_path):
    def interrupted(f):
        f.write(b"part")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        io.atomic_write(tmp_path / "f", interrupted)
    assert os.listdir(tmp_path) == []


def test_temporary_target_names_what_a_real_writers_temporary_file_was_to_replace(tmp_path):
    """The holder of a state directory removes what writers killed mid-write left by name
    (roles.state.hold_state_dir): the name atomic_write really gives its temporary file, seen
    from inside the write, must be told apart, and names it never gives must not."""
    seen = []
    for name in ("client.npz", "model.onnx.signed.json", "a.b.c"):
        io.atomic_write(tmp_path / name, lambda f: seen.append(
            sorted(n for n in os.listdir(tmp_path) if n.startswith("."))))
        (temporary,) = seen.pop()
        assert io.temporary_target(temporary) == name, temporary
    assert sorted(os.listdir(tmp_path)) == ["a.b.c", "client.npz", "model.onnx.signed.json"]
    for other in ("client.npz", ".client.npz.tmp", ".client.npz.abc.tmp",
                  ".client.npz.ABCDEFGH.tmp", ".client.npz.abcdefgh.tmp~",
                  ".model.onnx.1234.fp32.tmp", "x.client.npz.abcdefgh.tmp"):
        assert io.temporary_target(other) is None, other


def test_temporary_path_makes_a_private_empty_file_named_as_atomic_writes_are(tmp_path):
    """A writer that builds a file in place (the ONNX exporter) gets its temporary files
    from temporary_path, so the directory's holder knows them as temporary_target does."""
    first, second = io.temporary_path(tmp_path / "model.onnx"), io.temporary_path(
        tmp_path / "model.onnx")
    assert first != second
    for path in (first, second):
        assert os.path.dirname(path) == str(tmp_path)
        assert io.temporary_target(os.path.basename(path)) == "model.onnx", path
        assert os.path.getsize(path) == 0 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(FileNotFoundError, match=f"cannot write {tmp_path / 'absent' / 'f'}"):
        io.temporary_path(tmp_path / "absent" / "f")


def test_atomic_write_into_a_missing_directory_fails_naming_it(tmp_path):
    # the message names the file asked for and its missing directory, not the temporary
    # file that atomic_write would have made there (a name the caller never gave)
    with pytest.raises(FileNotFoundError) as info:
        io.atomic_write(tmp_path / "absent" / "f", b"x")
    message = str(info.value)
    assert f"cannot write {tmp_path / 'absent' / 'f'}" in message
    assert message.endswith(f": {tmp_path / 'absent'}")
    assert ".tmp" not in message and ".f." not in message
    assert info.value.errno == errno.ENOENT
    assert os.listdir(tmp_path) == []


def test_atomic_write_all_renames_only_once_every_file_is_written(tmp_path, fsynced):
    io.atomic_write_all([(tmp_path / "key", b"private", 0o600),
                         (tmp_path / "key.pub", "public", 0o644)])
    assert (tmp_path / "key").read_bytes() == b"private"
    assert (tmp_path / "key.pub").read_text() == "public"
    assert stat.S_IMODE(os.stat(tmp_path / "key").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "key.pub").st_mode) == 0o644
    # both files' temporaries, then their directory once
    assert os.path.basename(fsynced[0]).startswith(".key.")
    assert os.path.basename(fsynced[1]).startswith(".key.pub.")
    assert fsynced[2:] == [str(tmp_path)]
    assert sorted(os.listdir(tmp_path)) == ["key", "key.pub"]


@pytest.mark.parametrize("failing", [0, 1])
def test_atomic_write_all_replaces_none_when_one_file_fails(tmp_path, failing):
    # files that belong together (a key and its .pub): one that cannot be written whole
    # must not leave the other replaced
    paths = [tmp_path / "key", tmp_path / "key.pub"]
    for p in paths:
        p.write_text("old")

    def full(f):
        f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    files = [(p, full if i == failing else b"new", 0o644) for i, p in enumerate(paths)]
    with pytest.raises(OSError) as info:
        io.atomic_write_all(files)
    assert info.value.errno == errno.ENOSPC
    assert [p.read_text() for p in paths] == ["old", "old"]
    assert sorted(os.listdir(tmp_path)) == ["key", "key.pub"]


def test_atomic_write_all_into_a_missing_directory_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"cannot write {tmp_path / 'absent' / 'k'}:"):
        io.atomic_write_all([(tmp_path / "k.pub", b"x", 0o644),
                             (tmp_path / "absent" / "k", b"x", 0o600)])
    assert os.listdir(tmp_path) == []


def test_replace_atomic_renames_then_fsyncs_the_directory(tmp_path, fsynced):
    src, dst = tmp_path / ".dst.tmp", tmp_path / "dst"
    src.write_bytes(b"finished")
    dst.write_bytes(b"old")
    io.replace_atomic(src, dst)
    assert dst.read_bytes() == b"finished" and not src.exists()
    assert fsynced == [str(tmp_path)]


def test_jsonable_converts_to_plain_json_types():
    data = {
        1: np.float32(0.5),
        "ints": (np.int64(3), np.int32(-1)),
        "array": np.arange(4, dtype=np.float32).reshape(2, 2),
        "nonfinite": [float("nan"), math.inf, -math.inf, np.float64("nan"), np.float32("inf")],
        "nested": {"flag": np.bool_(True), "none": None, "text": "t"},
    }
    out = io.jsonable(data)
    assert out == {"1": 0.5, "ints": [3, -1], "array": [[0.0, 1.0], [2.0, 3.0]],
                   "nonfinite": [None] * 5,
                   "nested": {"flag": True, "none": None, "text": "t"}}
    assert type(out["ints"][0]) is int and type(out["1"]) is float
    assert type(out["nested"]["flag"]) is bool
    assert json.loads(json.dumps(out, allow_nan=False)) == out       # strict JSON


def test_write_json_writes_sanitised_json_with_a_final_newline(tmp_path, fsynced):
    path = tmp_path / "summary.json"
    io.write_json(path, {"accuracy": np.float32(0.25), "loss": float("nan")}, indent=2)
    text = path.read_text()
    assert text == '{\n  "accuracy": 0.25,\n  "loss": null\n}\n'
    assert fsynced[-1] == str(tmp_path)


def test_lock_exclusive_is_held_against_other_processes_until_the_holder_lets_go(tmp_path):
    """One process holds the lock (as a role holds its state directory); another finds it
    busy, or waits for it, and gets it once the holder exits, killed included."""
    import subprocess
    import sys

    from edgefl.io import lock_exclusive

    path = tmp_path / "d.lock"
    path.touch()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time\n"
         "f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX)\n"
         "print('held', flush=True); time.sleep(float(sys.argv[2]))\n", str(path), "1.0"],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    fd = os.open(path, os.O_RDONLY)
    try:
        assert lock_exclusive(fd) == "busy"
        assert lock_exclusive(fd, wait_s=30) == "waited"     # the holder exits after 1 s
    finally:
        os.close(fd)
        holder.wait(10)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time\n"
         "f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX)\n"
         "print('held', flush=True); time.sleep(60)\n", str(path)],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    holder.kill()
    holder.wait(10)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert lock_exclusive(fd) == "locked"
    finally:
        os.close(fd)
