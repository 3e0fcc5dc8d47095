"""Device profiles: one YAML file per board in edgefl/profiles/ (rpi-zero2w, rpi3, rpi4, rpi5,
jetson-nano, generic-x86), each opening with a comment on the board, and the helpers that
apply a profile's compute settings to the running process.

A profile is the second layer of a service's configuration (edgefl.service.layered): it sets
compute.threads, compute.memory_budget_mb, train.batch_size, transport.compression,
transport.chunk_size, infer.threads and suggested_model. Profiles ship inside the package
(package data), so `edgefl install-service --profile rpi4` works from a wheel without a
checkout; devices/README.md points to them.
"""
from __future__ import annotations

import os
import platform
import re
from importlib import resources

__all__ = ["PROFILE_KEYS", "MemoryBudgetError", "apply_threads", "board_comment", "board_summary",
           "check_memory_budget", "detect_profile", "profile_names", "profile_path",
           "resident_mb"]

DEVICE_TREE_MODEL = "/proc/device-tree/model"

# The keys a profile may set: what depends on the board, nothing about the site.
PROFILE_KEYS = ("compute.threads", "compute.memory_budget_mb", "train.batch_size",
                "transport.compression", "transport.chunk_size", "infer.threads",
                "suggested_model")

# /proc/device-tree/model text -> profile; first match wins (Zero 2 before any other Pi)
_BOARDS = (
    (re.compile(r"Raspberry Pi Zero 2"), "rpi-zero2w"),
    (re.compile(r"Raspberry Pi (3\b|Compute Module 3)"), "rpi3"),
    (re.compile(r"Raspberry Pi (4\b|400\b|Compute Module 4)"), "rpi4"),
    (re.compile(r"Raspberry Pi (5\b|500\b|Compute Module 5)"), "rpi5"),
    (re.compile(r"NVIDIA Jetson Nano"), "jetson-nano"),
)
_X86_64 = ("x86_64", "amd64")


def _profile_dir():
    return resources.files("edgefl").joinpath("profiles")


def profile_names() -> list[str]:
    """The shipped profiles, sorted."""
    root = _profile_dir()
    if not root.is_dir():
        return []
    return sorted(entry.name[:-5] for entry in root.iterdir() if entry.name.endswith(".yaml"))


def profile_path(name: str) -> str:
    """The file of profile `name`; ValueError listing the valid profiles otherwise."""
    names = profile_names()
    if name not in names:
        raise ValueError(f"unknown profile {name!r}; valid profiles: {', '.join(names)}")
    return str(_profile_dir().joinpath(f"{name}.yaml"))


def board_comment(name: str) -> str:
    """The comment a profile opens with (what board it is for), without the '#'s."""
    lines = []
    with open(profile_path(name), encoding="utf-8") as f:
        for line in f:
            if not line.startswith("#"):
                break
            lines.append(line[1:].strip())
    return " ".join(lines)


def board_summary(name: str) -> str:
    """The first sentence of the board comment: the board, its CPU, cores and memory."""
    text = board_comment(name)
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def detect_profile(model_file: str = DEVICE_TREE_MODEL,
                   machine: str | None = None) -> tuple[str | None, str]:
    """(profile, how it was found) for this machine: the board named by the device tree
    (Raspberry Pi, Jetson Nano), else generic-x86 on an x86-64 CPU; (None, why) when no
    profile fits (e.g. a Pi Zero / Pi 1, whose ARMv6 CPU no wheel supports)."""
    machine = (machine or platform.machine()).lower()
    model = None
    try:
        with open(model_file, "rb") as f:
            model = f.read().rstrip(b"\0\n").decode("utf-8", "replace").strip()
    except OSError:
        pass
    if model:
        for pattern, name in _BOARDS:
            if pattern.search(model):
                return name, f"{model_file}: {model!r}"
    if machine in _X86_64:
        return "generic-x86", f"CPU architecture {machine}" + (f" ({model!r})" if model else "")
    board = f"board {model!r}" if model else f"no board name in {model_file}"
    return None, f"{board}, CPU architecture {machine}: no profile matches"


def apply_threads(threads: int) -> int:
    """Use `threads` GEMM threads in the C core's training (0: every CPU this process may run
    on). Returns the count in effect: 1 when the core has no BLAS (the portable GEMM on
    armhf, or EDGEFL_BACKEND=numpy), where the setting cannot apply."""
    from .. import kernels

    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ValueError(f"compute.threads = {threads!r}: need an integer >= 0 (0: all CPUs)")
    if threads == 0:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            (os.cpu_count() or 1)
    have_blas = getattr(kernels.impl, "have_blas", None)
    if have_blas is None or not have_blas():
        return 1
    kernels.impl.blas_set_threads(threads)
    return threads


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def resident_mb(peak: bool = False) -> float:
    """This process's resident memory in MiB (VmRSS), or its peak so far (VmHWM)."""
    kb = _status_kb("VmHWM" if peak else "VmRSS")
    if kb is None:  # not Linux: ru_maxrss is the peak, in KiB on Linux and bytes on macOS
        import resource
        import sys
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        kb = rss // 1024 if sys.platform == "darwin" else rss
    return kb / 1024


class MemoryBudgetError(ValueError):
    """The process holds more memory than the profile's compute.memory_budget_mb (a
    ValueError: a configuration the board cannot run, reported in one line by the CLI)."""


def check_memory_budget(budget_mb: int, what: str) -> float:
    """Raise MemoryBudgetError when this process's resident memory exceeds `budget_mb`; call
    it after loading the local data (what: "after loading data"). Returns the resident MiB."""
    rss = resident_mb()
    if rss > budget_mb:
        raise MemoryBudgetError(
            f"{rss:.0f} MiB resident {what}, over compute.memory_budget_mb = {budget_mb}: "
            f"train on fewer samples (data.limit_train) or raise the budget in the site file")
    return rss
