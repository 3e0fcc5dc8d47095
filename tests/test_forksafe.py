"""edgefl.forksafe: a fork of the process waits while an edgefl thread is inside OpenSSL.

A child forked while another thread held one of OpenSSL's locks inherits the lock held and
hangs on its first use of it; `edgefl simulate --transport mqtt` forks its worker processes
from a process whose other threads may be generating keys (a CI run hung so). These tests
hold the guard's two sides against each other with real forks, and check that edgefl's
entry points into OpenSSL take the guard: while a fork is pending, each of them waits."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from edgefl import forksafe, kernels
from edgefl.privacy import secagg
from edgefl.transport import signing

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _wait_child(pid: int, timeout: float = 30.0) -> int:
    """The child's exit status; fails if it is still running after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail(f"forked child {pid} did not finish within {timeout:g} s")


def _hold_section() -> tuple:
    """A thread inside `forksafe.openssl()` until the returned event is set: (event, thread)."""
    inside, release = threading.Event(), threading.Event()

    def in_openssl():
        with forksafe.openssl():
            inside.set()
            release.wait(30)

    holder = threading.Thread(target=in_openssl)
    holder.start()
    assert inside.wait(10)
    return release, holder


def test_a_fork_waits_for_a_thread_inside_openssl_and_the_child_can_enter():
    release, holder = _hold_section()
    forked = {}

    def fork():
        pid = os.fork()
        if pid == 0:
            # the child: the guard is fresh (the holder thread is not here), so a section
            # opens at once, and a fork of the child's own works too
            try:
                with forksafe.openssl():
                    signing.generate_key()
                grandchild = os.fork()
                if grandchild == 0:
                    os._exit(0)
                os._exit(0 if os.waitpid(grandchild, 0)[1] == 0 else 3)
            except BaseException:
                os._exit(2)
        forked["pid"], forked["at"] = pid, time.monotonic()

    forker = threading.Thread(target=fork)
    forker.start()
    time.sleep(0.3)
    assert "pid" not in forked, "the fork happened while a thread was inside OpenSSL"
    released_at = time.monotonic()
    release.set()
    forker.join(10)
    holder.join(10)
    assert forked["at"] >= released_at
    assert _wait_child(forked["pid"]) == 0


def test_sections_do_not_wait_for_each_other():
    release, holder = _hold_section()
    started = time.monotonic()
    with forksafe.openssl():                     # a second section: no fork pending
        pass
    assert time.monotonic() - started < 1.0
    release.set()
    holder.join(10)


def test_a_failing_section_leaves_the_guard_usable():
    with pytest.raises(ValueError, match="inside"):
        with forksafe.openssl():
            raise ValueError("inside")
    pid = os.fork()                              # would wait for ever on a leaked section
    if pid == 0:
        os._exit(0)
    assert _wait_child(pid, timeout=10) == 0


def _setup(participants=(0, 1)):
    return secagg.RoundSetup("run", 1, tuple(participants), len(participants), 0, 7, 32, 1.0,
                             1 << 16, 10, 8, ())


def _entry_points():
    key = signing.generate_key()
    signer = signing.Signer(key, "client-0", "fed")
    verifier = signing.Verifier("fed", {"client-0": [key.public_key()]})
    env = signer.envelope("update", "run", 1, "ab" * 32)
    words, scalars = np.zeros(4096, np.uint32), np.zeros(2, np.uint64)
    return {
        "signing.generate_key": signing.generate_key,
        "Signer.envelope (Ed25519 sign)": lambda: signer.envelope("update", "run", 1, "ab" * 32),
        "Verifier.verify (Ed25519 verify)":
            lambda: verifier.verify(env, "ab" * 32, kind="update", where="test"),
        "SecAggClient (X25519 keys)": lambda: secagg.SecAggClient(0, _setup()),
        "secagg.mask_stream (AES-CTR)": lambda: secagg.mask_stream(bytes(32), 64),
        "kernels.secagg_mask": lambda: kernels.secagg_mask(words, scalars, bytes(32), b"\0"),
    }


@pytest.mark.parametrize("name", list(_entry_points()))
def test_edgefl_entry_points_into_openssl_wait_for_a_pending_fork(name):
    """With a fork pending (the guard taken as the at-fork hook takes it), each entry point
    waits; once the fork is over it runs."""
    call = _entry_points()[name]
    call()                                       # warm: first-use set-up is not measured
    guard = forksafe._GUARD
    guard.before_fork()
    done = threading.Event()
    errors = []

    def run():
        try:
            call()
        except BaseException as exc:             # noqa: BLE001 -- reported below
            errors.append(exc)
        done.set()

    t = threading.Thread(target=run)
    try:
        t.start()
        assert not done.wait(0.3), f"{name} entered OpenSSL while a fork was pending"
    finally:
        guard.after_fork_in_parent()
    assert done.wait(10), f"{name} did not run once the fork was over"
    t.join(10)
    assert not errors, errors
