"""OpenSSL work and `os.fork` exclude each other in an edgefl process.

A forked child gets a copy of every lock as it was at the fork, with none of the threads
that held them. OpenSSL's locks (its random generator's, its algorithm store's) are among
them: a child forked while another thread of the parent was inside OpenSSL, generating a key
say, blocks for ever on its own first use of that lock. `cryptography` releases the
interpreter lock around such calls, so holding the GIL while forking does not prevent this.
It happened: `edgefl simulate --transport mqtt` forks its worker processes (sim.over_broker),
and in one CI run a worker's first X25519 key generation hung for ever; the parent's thread
that was inside OpenSSL at the fork was not identified. Reproduced stand-alone: two threads
generating X25519 keys in a loop, repeated forks, each child generating a key: 1 child of
300 hung (HKDF: 1 of 400); with nothing inside OpenSSL at the forks, 0 of 1,000.

So every call of edgefl into OpenSSL (`cryptography`'s keys, signatures, key agreement,
ciphers and key derivation; the C core's mask expansion through the process's libcrypto)
runs inside `openssl()`, and a fork waits, in an `os.register_at_fork` hook, until no thread
is inside one and lets none enter until it is done. Sections run at the same time as each
other; only a fork waits for them. Never fork from inside a section: the fork would wait for
its own thread.

This covers edgefl's own threads, which is what a process of edgefl's has beside the forking
thread (the roles, their pools). Threads of other code that use OpenSSL are not covered."""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager

__all__ = ["openssl"]


class _Guard:
    """Any number of sections at once, or one fork."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inside = 0

    def enter(self) -> None:
        with self._lock:                 # held by a fork in progress: wait for it
            self._inside += 1

    def leave(self) -> None:
        with self._lock:
            self._inside -= 1
            if self._inside == 0:
                self._idle.notify_all()

    def before_fork(self) -> None:
        # take the lock and keep it through the fork: no section starts until it is done
        self._lock.acquire()
        while self._inside:
            self._idle.wait()

    def after_fork_in_parent(self) -> None:
        self._lock.release()

    def after_fork_in_child(self) -> None:
        # the child has only the forking thread, which was in no section: a fresh guard
        self.__init__()


_GUARD = _Guard()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_GUARD.before_fork, after_in_parent=_GUARD.after_fork_in_parent,
                        after_in_child=_GUARD.after_fork_in_child)


@contextmanager
def openssl():
    """A call into OpenSSL: a fork of this process waits until it is over."""
    _GUARD.enter()
    try:
        yield
    finally:
        _GUARD.leave()
