"""Helpers shared by the tools/bench_*.py benchmarks: interleaved median timing, the CPU
time /proc gives a process or a thread, the environment of a child process that runs a given
checkout's edgefl (`child_env`, for --before), and the Markdown table every tool prints (or
the same as JSON, `print_result`)."""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable


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
