"""Helpers shared by the tools/bench_*.py benchmarks: interleaved median timing and the
Markdown table every tool prints."""
from __future__ import annotations

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
