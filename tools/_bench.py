"""Helpers shared by the tools/bench_*.py benchmarks: interleaved median timing, the CPU
time /proc gives a process or a thread, the memory /proc gives a process (`memory_of`) and
a tree of them sampled from outside (`PeakPss`), the environment of a child process that runs
a given checkout's edgefl (`child_env`, for --before), the Markdown table every tool
prints (or the same as JSON, `print_result`), and the check of counts given on a command
line (`need_counts`)."""
from __future__ import annotations

import contextlib
import json
import os
import select
import statistics
import subprocess
import sys
import time
import types
from typing import Callable


def need_counts(parser, args, *names) -> None:
    """parser.error (usage, exit status 2) for an option of `names` below 1: a run of 0
    repeats, frames or clients measures nothing, and its empty table or a median of no
    data ('no median for empty data') would say so only in a traceback."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} {value}: need at least 1")


def time_medians(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median wall time of each fn over `repeats` rounds, after one untimed warm-up call each.
    Rounds interleave the functions, so a drifting machine (other jobs, turbo) biases none."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def child_env(scratch: str, tree: str | None) -> dict:
    """The environment of a benchmark's child process: one BLAS thread, bytecode cached in
    `scratch` (not written into another checkout), and `tree`'s edgefl first on the path
    when given (a --before checkout; None: whatever this environment imports)."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = os.path.join(scratch, "pycache")
    env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = "1"
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([tree] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def cpu_seconds(pid: int, tid: int | None = None) -> float | None:
    """User + system CPU seconds of process `pid` so far, or of its thread `tid`
    (/proc/PID[/task/TID]/stat, in clock ticks of 10 ms); None once it is gone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path, "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def memory_of(pid: int) -> tuple[int, int] | None:
    """(RSS, PSS) of process `pid` in bytes (/proc/PID/smaps_rollup: PSS splits each shared
    page between the processes that map it, so forked workers' copy-on-write view of a data
    set counts once); None once it is gone (a zombie has no smaps)."""
    rss = pss = None
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
                    break                                   # Pss follows Rss
    except (OSError, ValueError, IndexError):
        return None
    return (rss or 0, pss or 0) if pss is not None else None


def children(pid: int) -> list:
    """The direct children of process `pid`: /proc/PID/task/*/children (a few small files),
    else, on a kernel without them, every process's /proc/PID/stat parent field."""
    try:
        kids = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as fh:
                kids += [int(k) for k in fh.read().split()]
        return kids
    except FileNotFoundError:
        pass                               # no such file (or the process or a thread went)
    except (OSError, ValueError):
        return []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    kids = []
    for child in pids:
        try:
            with open(f"/proc/{child}/stat", encoding="ascii", errors="replace") as fh:
                if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(child)
        except (OSError, ValueError, IndexError):
            continue
    return kids


def tree_pss(pid: int, exclude=()) -> int:
    """Bytes: PSS of process `pid` and its direct children, but those in `exclude`."""
    total = 0
    for p in [pid, *children(pid)]:
        if p not in exclude:
            total += (memory_of(p) or (0, 0))[1]
    return total


class PeakPss:
    """The peak PSS of process `pid` (default: this one) and its direct children during the
    spans `measure()` marks, sampled every `every_s` by a child process that idles in
    between (its own memory left out), at the lowest priority. Not a thread of the measured
    process: each sample reads /proc for a few milliseconds, and a thread would hold that
    process's interpreter lock meanwhile (bench_scale: the aggregator's, in the rounds it
    times).

        sampler = PeakPss()
        with sampler.measure() as mem:
            run()
        mem.peak                     # bytes
        sampler.close()
    """

    def __init__(self, pid: int | None = None, every_s: float = 0.25):
        self._proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "peak-pss",
             str(os.getpid() if pid is None else pid), str(every_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @contextlib.contextmanager
    def measure(self):
        self._proc.stdin.write(b"s")
        self._proc.stdin.flush()
        span = types.SimpleNamespace(peak=0)
        try:
            yield span
        finally:
            self._proc.stdin.write(b"e")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
            if not line:
                raise RuntimeError("PeakPss: the sampler process ended "
                                   f"(exit status {self._proc.wait()})")
            span.peak = int(line)

    def close(self) -> None:
        self._proc.stdin.close()          # end of input: the sampler exits
        self._proc.wait(timeout=10)
        self._proc.stdout.close()


def _serve_peak_pss(pid: int, every_s: float) -> None:
    """PeakPss's child: b"s" on stdin starts a span, b"e" ends it and the span's peak is
    written as a line; end of input ends the process. Blocked on stdin between spans.
    Niced: a sample is a walk of every mapped page (milliseconds for a few hundred MB), CPU
    that the measured processes should have first."""
    os.nice(19)
    me, fd = os.getpid(), sys.stdin.fileno()
    while True:
        got = os.read(fd, 64)
        if not got:
            return
        peak = tree_pss(pid, exclude=(me,))
        while b"e" not in got:
            if select.select([fd], [], [], every_s)[0]:
                more = os.read(fd, 64)
                if not more:
                    return
                got += more
            else:
                peak = max(peak, tree_pss(pid, exclude=(me,)))
        peak = max(peak, tree_pss(pid, exclude=(me,)))
        os.write(1, b"%d\n" % peak)


def markdown(rows: list[dict]) -> str:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]

    def cell(v):
        if v is None:
            return ""
        if isinstance(v, int) and not isinstance(v, bool) and v >= 10_000:
            return f"{v:,}".replace(",", "_")
        return str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def print_result(meta: dict, rows: list[dict], title: str, as_json: bool) -> None:
    """A benchmark's result: {"meta", "rows"} as JSON (--json), else `title` as a Markdown
    heading over the rows' table."""
    if as_json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=1))
    else:
        print(f"# {title}\n")
        print(markdown(rows))


if __name__ == "__main__" and sys.argv[1:2] == ["peak-pss"]:
    _serve_peak_pss(int(sys.argv[2]), float(sys.argv[3]))
