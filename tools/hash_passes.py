"""A pytest plugin that counts the sha256 passes over 2 KB or more made while the tests run,
by the function that started each hash (docs/security.md "Cost": which of a round's hashes
signing adds, before and after a change). It replaces hashlib.sha256 with a counting
wrapper before the tests import edgefl, so it measures counts, not time. Use:

    PYTHONPATH=.:tools python -m pytest -q -p hash_passes tests/test_signing.py \\
        -k copies_of_the_model

prints `sha256 passes by caller: {...}` at exit. The model of that test is 650 float32
parameters (2,600 bytes), so every pass over a model or an update is counted and the
signature envelopes and JSON documents (under 2 KB) are not."""
from __future__ import annotations

import atexit
import collections
import hashlib
import sys

MIN_BYTES = 2048
counts: collections.Counter = collections.Counter()
_sha256 = hashlib.sha256


class _Counted:
    def __init__(self, data=b"", **options):
        self._h = _sha256(data, **options)
        self._n = memoryview(data).nbytes
        f = sys._getframe(1)
        self._who = f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_code.co_name}"
        self._counted = False

    def update(self, data) -> None:
        self._n += memoryview(data).nbytes
        self._h.update(data)

    def _count(self) -> None:
        if self._n >= MIN_BYTES and not self._counted:
            self._counted = True
            counts[self._who] += 1

    def hexdigest(self) -> str:
        self._count()
        return self._h.hexdigest()

    def digest(self) -> bytes:
        self._count()
        return self._h.digest()

    def copy(self):
        other = _Counted.__new__(_Counted)
        other._h, other._n, other._who, other._counted = self._h.copy(), self._n, self._who, False
        return other


hashlib.sha256 = _Counted
atexit.register(lambda: print("sha256 passes by caller:", dict(sorted(counts.items()))))
