"""The decoded-data cache (edgefl.data.cache): a cached load gives the arrays a fresh decode
gives, a changed source is decoded again, and a cache file that cannot be read -- truncated,
garbage, another format -- is rebuilt with a warning, never an error."""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from edgefl.data import load_dataset
from edgefl.data.cache import SOURCE_HASHES, cache_dir
from edgefl.data.datasets import _sklearn_digits_file

from test_data import idx_bytes, write_mnist_dir

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    monkeypatch.setenv("EDGEFL_CACHE_DIR", str(directory))
    return directory


def same(a, b):
    for key in ("x_train", "y_train", "x_test", "y_test", "norm_mean", "norm_std"):
        np.testing.assert_array_equal(getattr(a, key), getattr(b, key), err_msg=key)
    assert (a.name, a.num_classes, a.class_names, a.raw_range, a.input_shape) == \
        (b.name, b.num_classes, b.class_names, b.raw_range, b.input_shape)


def data_files(cache):
    """The cache's data files: not the memo of the sources' hashes (SOURCE_HASHES)."""
    return sorted(f for f in os.listdir(cache) if f != SOURCE_HASHES)


def uncached(name, monkeypatch, **options):
    with monkeypatch.context() as m:
        m.setenv("EDGEFL_CACHE_DIR", "off")
        return load_dataset(name, **options)


def test_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("EDGEFL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == str(tmp_path / "xdg" / "edgefl")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == str(tmp_path / "home" / ".cache" / "edgefl")
    monkeypatch.setenv("EDGEFL_CACHE_DIR", "off")
    assert cache_dir() is None


def test_digits_from_the_cache_equal_a_fresh_decode(cache, monkeypatch):
    pytest.importorskip("sklearn")
    if _sklearn_digits_file() is None:
        pytest.skip("scikit-learn's digits file is not where the cache looks for it")
    fresh = uncached("digits", monkeypatch)
    assert not cache.exists()                      # off means off
    first = load_dataset("digits")                 # decodes and writes the cache
    files = data_files(cache)
    assert len(files) == 1 and files[0].startswith("digits-") and files[0].endswith(".npz")
    second = load_dataset("digits")                # reads it
    same(fresh, first)
    same(fresh, second)
    assert data_files(cache) == files
    assert not [f for f in os.listdir(cache) if f.endswith(".tmp")]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "other-arrays"])
def test_an_unreadable_cache_file_is_rebuilt_not_fatal(cache, monkeypatch, tmp_path, caplog,
                                                       damage):
    arrays = write_mnist_dir(tmp_path / "mnist")
    fresh = uncached("mnist", monkeypatch, path=str(tmp_path / "mnist"))
    load_dataset("mnist", path=str(tmp_path / "mnist"))
    (name,) = data_files(cache)
    path = str(cache / name)
    good = open(path, "rb").read()
    if damage == "truncated":
        bad = good[:len(good) // 2]
    elif damage == "garbage":
        bad = b"\x00not a zip file" * 100
    elif damage == "empty":
        bad = b""
    else:                                           # a valid npz, but not a cache file
        import io
        buf = io.BytesIO()
        np.savez(buf, x=np.zeros(3))
        bad = buf.getvalue()
    with open(path, "wb") as f:
        f.write(bad)
    with caplog.at_level(logging.WARNING, logger="edgefl.data.cache"):
        again = load_dataset("mnist", path=str(tmp_path / "mnist"))
    same(fresh, again)
    np.testing.assert_array_equal(again.y_train, arrays["train-labels-idx1-ubyte"])
    assert any("unreadable" in r.getMessage() and path in r.getMessage() and
               "decoding mnist again" in r.getMessage() for r in caplog.records)
    assert open(path, "rb").read() == good           # rewritten whole
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgefl.data.cache"):
        same(fresh, load_dataset("mnist", path=str(tmp_path / "mnist")))
    assert not caplog.records


def test_a_changed_source_file_is_decoded_again(cache, tmp_path):
    directory = tmp_path / "mnist"
    write_mnist_dir(directory)
    before = load_dataset("mnist", path=str(directory))
    # the same size, rewritten in place at once: only the content tells it apart
    labels = os.path.join(directory, "train-labels-idx1-ubyte")
    changed = (np.arange(12)[::-1] % 10).astype(np.uint8)
    with open(labels, "wb") as f:
        f.write(idx_bytes(changed, 0x08))
    after = load_dataset("mnist", path=str(directory))
    np.testing.assert_array_equal(after.y_train, changed)
    assert not np.array_equal(before.y_train, after.y_train)
    assert len(data_files(cache)) == 2


def test_a_cache_directory_that_cannot_be_written_only_costs_speed(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory would go")
    monkeypatch.setenv("EDGEFL_CACHE_DIR", str(blocker / "edgefl"))
    arrays = write_mnist_dir(tmp_path / "mnist")
    ds = load_dataset("mnist", path=str(tmp_path / "mnist"))
    np.testing.assert_array_equal(ds.y_test, arrays["t10k-labels-idx1-ubyte"])


def test_a_bad_source_is_reported_as_before_and_nothing_is_cached(cache, tmp_path):
    write_mnist_dir(tmp_path / "mnist")
    with open(tmp_path / "mnist" / "train-labels-idx1-ubyte", "wb") as f:
        f.write(b"\x00\x00\x08")
    with pytest.raises(ValueError, match="train-labels-idx1-ubyte: .*too short"):
        load_dataset("mnist", path=str(tmp_path / "mnist"))
    assert not cache.exists() or not data_files(cache)


def test_a_source_hash_is_remembered_only_for_a_settled_file(cache, tmp_path, monkeypatch):
    import json
    import time
    from edgefl.data import cache as module
    write_mnist_dir(tmp_path / "mnist")
    load_dataset("mnist", path=str(tmp_path / "mnist"))       # just written: not remembered
    assert not (cache / SOURCE_HASHES).exists()
    old = 1_000_000_000                                        # settled: mtime long ago
    for name in os.listdir(tmp_path / "mnist"):
        os.utime(tmp_path / "mnist" / name, (old, old))
    monkeypatch.setattr(module, "SETTLED_S", -1e12)            # (ctime is now: pretend settled)
    first = load_dataset("mnist", path=str(tmp_path / "mnist"))
    memo = json.loads((cache / SOURCE_HASHES).read_text())
    assert len(memo) == 4
    hashed = []
    monkeypatch.setattr(module, "_identity", lambda p: hashed.append(p) or "x")
    same(first, load_dataset("mnist", path=str(tmp_path / "mnist")))   # from the memo
    assert hashed == []
    # a change, even of the same size and with the old mtime, moves ctime: hashed again
    labels = tmp_path / "mnist" / "train-labels-idx1-ubyte"
    time.sleep(0.05)     # past the ctime clock's tick (this test remembered an unsettled file)
    labels.write_bytes(labels.read_bytes())
    os.utime(labels, (old, old))
    module.cache_path("mnist", [str(labels)])
    assert hashed == [str(labels)]


# A process that loads mnist from a directory, its decode slowed and counted (one line per
# decode in a shared file), so that processes started together overlap in it; with "crash" it
# kills itself (SIGKILL: no cleanup runs) half-way through writing the cache file.
_LOADER = r"""
import hashlib, os, signal, sys, time
from edgefl.data import datasets, load_dataset
from edgefl.data import cache as module
directory, counter, mode = sys.argv[1:4]
decode = datasets._decode_idx_dataset
def counted(*args):
    with open(counter, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(1.0)
    return decode(*args)
datasets._decode_idx_dataset = counted
if mode == "crash":
    def half_then_die(f, raw):
        f.write(b"PK\x03\x04" + b"\0" * 4096)
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    module._write = half_then_die
ds = load_dataset("mnist", path=directory)
print(hashlib.sha256(ds.x_train.tobytes() + ds.y_train.tobytes()).hexdigest())
"""


def _loaders(tmp_path, cache, modes):
    import subprocess
    import sys
    script = tmp_path / "loader.py"
    script.write_text(_LOADER)
    env = {**os.environ, "EDGEFL_CACHE_DIR": str(cache)}     # (conftest: this checkout)
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "mnist"),
                               str(tmp_path / "decodes"), mode], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for mode in modes]
    try:
        return [(p.wait(timeout=120), *p.communicate()) for p in procs]
    finally:
        for p in procs:               # a loader that hung is not left running
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_processes_that_start_together_decode_once_and_read_one_whole_file(cache, tmp_path):
    # `edgefl fleet up` or two simulate runs on a cold cache: each process decoded and wrote
    # its own copy (Fashion-MNIST: 55 MB of temporary file and a decode each)
    write_mnist_dir(tmp_path / "mnist")
    results = _loaders(tmp_path, cache, ["load"] * 4)
    assert [rc for rc, _, _ in results] == [0] * 4, results
    assert len({out for _, out, _ in results}) == 1
    assert len((tmp_path / "decodes").read_text().split()) == 1
    (name,) = data_files(cache)
    assert name.startswith("mnist-") and name.endswith(".npz")


def test_a_writer_killed_mid_write_leaves_nothing_the_next_load_keeps(cache, tmp_path):
    # atomic_write leaves the old file or none, but a SIGKILL (the OOM killer, a power cut)
    # skips its cleanup: the half-written temporary file stayed in the cache for good, up to
    # 55 MB for Fashion-MNIST at every crash
    # (removed by the name atomic_write gives, io.temporary_target, as the roles do: a file
    # no edgefl writer names, in the cache directory too, is left alone)
    write_mnist_dir(tmp_path / "mnist")
    ((rc, _, _),) = _loaders(tmp_path, cache, ["crash"])
    assert rc == -9
    (left,) = data_files(cache)                        # the crash's half-written file
    assert left.startswith(".mnist-") and left.endswith(".tmp")
    stranger = cache / ".mnist.npz.backup.tmp"         # named like one, by no edgefl writer
    stranger.write_text("the operator's")
    ((rc, out, err),) = _loaders(tmp_path, cache, ["load"])
    assert rc == 0, err
    (name,) = [n for n in data_files(cache) if n != stranger.name]
    assert name.startswith("mnist-") and name.endswith(".npz")
    assert stranger.read_text() == "the operator's"
    assert load_dataset("mnist", path=str(tmp_path / "mnist")).y_train.tolist() == \
        [i % 10 for i in range(12)]
