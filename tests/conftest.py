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
from pathlib import Path

import pytest

# Every process a test starts imports this checkout's edgefl, as the tests themselves do:
# beside an editable install of another clone, `python -m edgefl.cli` in a temporary
# directory took that clone's code, so a test of a fix here passed or failed on the other
# code (tests/test_fleet.py did). Tests that need another PYTHONPATH set their own env.
_CHECKOUT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_CHECKOUT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                   if p and p != _CHECKOUT])


# Modules whose subject is how processes, brokers, files and browsers behave: the transport
# and its wire format, the broker's accounts and ACL, signatures, the services and their
# signals, the fleet, the dashboard, chaos, the README's commands, the board in a box. They
# train through whichever backend is active, but nothing they check depends on it, and the
# numerics of both backends are covered by the in-process tests (the C/NumPy parity tests,
# every strategy's contract, the simulations). CI's second pass (EDGEFL_BACKEND=numpy, see
# .ci/run) skips them to stay within its time; EDGEFL_TEST_ALL_BACKENDS=1 runs them anyway.
PROCESS_LEVEL = {
    "test_access", "test_accounts", "test_async_mqtt", "test_board", "test_chaos",
    "test_dashboard", "test_fleet", "test_fuzz", "test_limits", "test_orchestration",
    "test_readme", "test_scale_broker", "test_service", "test_signals_e2e", "test_signing",
    "test_startup", "test_transport", "test_wire", "test_layers", "test_docs_standalone",
}


def pytest_collection_modifyitems(config, items):
    if os.environ.get("EDGEFL_BACKEND") != "numpy" or os.environ.get("EDGEFL_TEST_ALL_BACKENDS"):
        return
    skip = pytest.mark.skip(reason="process-level test, backend-independent: run in the "
                                   "compiled-backend pass (EDGEFL_TEST_ALL_BACKENDS=1 runs it "
                                   "here too)")
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in PROCESS_LEVEL:
            item.add_marker(skip)


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


# the digits data set and a softmax model for it, shared by the strategy, partition and
# serving tests (imported when first asked for, so collecting the suite loads no data)
@pytest.fixture(scope="module")
def digits():
    from edgefl.data import load_dataset

    return load_dataset("digits")


@pytest.fixture(scope="module")
def softmax(digits):
    from edgefl.models import build_model

    return build_model("softmax", digits.input_shape, digits.num_classes)
