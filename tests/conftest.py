"""Shared test hygiene.

Commands run in-process (`edgefl.cli.main([...])` for aggregator, client, serve, ...) call
`edgefl.service.logs.setup_logging`, which installs a handler on the root logger writing to
the sys.stderr of that moment -- under pytest, a capture stream closed when the test ends.
Left installed, the next test's log records go to that closed stream ("--- Logging error
---" on stderr) and any test that checks stderr fails depending on test order. Each test gets
the logging configuration it started with back.
"""
from __future__ import annotations

import logging
import os

import pytest


@pytest.fixture(autouse=True)
def _restore_logging():
    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in ("edgefl",)]
    saved = [(lg, list(lg.handlers), lg.level) for lg in loggers]
    yield
    for lg, handlers, level in saved:
        for handler in [h for h in lg.handlers if h not in handlers]:
            lg.removeHandler(handler)
        lg.setLevel(level)


@pytest.fixture
def fsynced(monkeypatch):
    """The paths os.fsync was called on, in order (the fd's target, read from /proc)."""
    paths = []
    real = os.fsync

    def record(fd):
        paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return paths


@pytest.fixture(autouse=True, scope="session")
def _data_cache(tmp_path_factory):
    """Decoded data sets (edgefl.data.cache) go to this session's own directory, inherited
    by the commands the tests start, never to the user's ~/.cache."""
    saved = os.environ.get("EDGEFL_CACHE_DIR")
    os.environ["EDGEFL_CACHE_DIR"] = str(tmp_path_factory.mktemp("data-cache"))
    yield
    if saved is None:
        os.environ.pop("EDGEFL_CACHE_DIR", None)
    else:
        os.environ["EDGEFL_CACHE_DIR"] = saved
