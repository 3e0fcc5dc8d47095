"""Allocator settings for processes that move multi-megabyte frames (the MQTT roles).

Every round an aggregator reassembles one frame per client and a client one model, each a
fresh bytes object of 4 bytes per parameter, and frees them a round later. glibc serves
allocations above its mmap threshold (128 KiB at first, raised by itself only up to the
size of the last mmap'ed block freed) with a new mapping each time, so every frame paid a
page fault per 4 KiB touched and an munmap: measured here on a 1M-parameter model, the
aggregator's join of an update's chunks took 6 ms instead of 0.1 ms, and its CPU per round
fell by 30% with the thresholds below (tools/bench_transport.py --only round). Keeping such
blocks in the heap lets the next round's frames reuse the same, already mapped memory.

The cost is that freed frame memory stays with the process until it is reused, which a
process that allocates the same sizes every round does at once; the peak resident set is
unchanged. Other C libraries (musl, macOS) are left alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's own ceiling for the mmap threshold it adapts (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
# targets; 512 KiB on 32-bit ones, where address space is scarcer) and, as glibc sets it
# when it adapts, a trim threshold of twice that
MMAP_THRESHOLD = 32 * 1024 * 1024 if sys.maxsize > 2 ** 32 else 512 * 1024
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD

_done = False


def keep_frames_in_heap() -> bool:
    """Set glibc's mmap and trim thresholds once per process (see the module docstring).
    Returns whether they were set: False on other C libraries, or if mallopt refused."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        gnu = libc.gnu_get_libc_version           # glibc only: musl has mallopt as a stub
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and \
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if ok:
        _done = True
        gnu.restype = ctypes.c_char_p
        log.debug("glibc %s: mmap threshold %d, trim threshold %d", gnu().decode(),
                  MMAP_THRESHOLD, TRIM_THRESHOLD)
    return ok
