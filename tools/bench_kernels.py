#!/usr/bin/env python3
"""Benchmarks of edgefl's kernels: prints a Markdown table, or the rows as JSON (--json).

Run from a checkout with the extension built in place (or edgefl installed):
    python tools/bench_kernels.py [--quick] [--json] [--only aggregate] [--mem-budget-gb 6]

Every benchmark is a function in BENCHMARKS that yields one dict per table row; rows share
the keys `bench`, `impl` and `median_s` (median wall time over `repeats` timed calls, after
one untimed warm-up call; the implementations compared in one row group take turns, so a
drifting machine biases none of them) and add their own. Everything runs on one thread: the BLAS/OpenMP
thread counts are pinned to 1 before NumPy is imported.

aggregate: out = sum_k w_k * x_k over K separate float32 buffers of P floats, for
  K in {10, 100} and P in {1M, 10M} (--quick: P = 1M only).
    c            edgefl._core.weighted_sum (one streaming pass, float64 block accumulator)
    numpy-naive  sum(w * x for w, x in zip(weights, xs)), the obvious NumPy code
    memcpy       np.copyto of each x_k into one P-float buffer: the same K*P*4 bytes read
  gb_per_s = (bytes read + bytes written) / median_s / 1e9, the same definition for all
  three: K*P*4 + P*4 bytes for c and numpy-naive (temporaries not counted), K*P*4 + K*P*4
  for memcpy. vs_memcpy = gb_per_s / memcpy's gb_per_s at the same K, P. Combinations whose
  buffers exceed the memory budget (default 6 GB, capped by MemAvailable) are reported as
  skipped rows.
"""
from __future__ import annotations

import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before numpy: one thread, comparable numbers
os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a source checkout

try:
    from edgefl import (
        _blas,  # noqa: F401  (preloads the BLAS the core links, as kernels.py)
        _core,
    )
    _NO_CORE = ""
except ImportError as exc:
    _core = None
    _NO_CORE = f"edgefl._core not built ({exc})"

GB = 1e9


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


def memory_budget(args) -> float:
    """Bytes a benchmark may allocate: --mem-budget-gb, capped at 80% of MemAvailable."""
    budget = args.mem_budget_gb * GB
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    budget = min(budget, 0.8 * int(line.split()[1]) * 1024)
    except OSError:
        pass
    return budget


# ---------------------------------------------------------------------------------------
# aggregate: weighted sum of K separate buffers
# ---------------------------------------------------------------------------------------

def bench_aggregate(args) -> Iterator[dict]:
    sizes = [1_000_000] if args.quick else [1_000_000, 10_000_000]
    repeats = 5 if args.quick else 7
    budget = memory_budget(args)
    for k in (10, 100):
        for p in sizes:
            base = {"bench": "aggregate", "K": k, "P": p}
            need = (k + 4) * p * 4  # inputs, out, memcpy target, numpy-naive's temporaries
            if need > budget:
                yield dict(base, impl="all", gb_per_s=None, median_s=None, repeats=0,
                           note=f"skipped: needs {need / GB:.1f} GB, budget {budget / GB:.1f} GB")
                continue
            yield from _aggregate_rows(base, k, p, repeats)


def _aggregate_rows(base: dict, k: int, p: int, repeats: int) -> Iterator[dict]:
    rng = np.random.default_rng(0)
    seed = rng.random(p, dtype=np.float32)  # real pages: np.zeros would map the zero page
    xs = []
    for i in range(k):
        x = np.empty(p, np.float32)
        np.multiply(seed, np.float32(1.0 + i / k), out=x)
        xs.append(x)
    weights = rng.dirichlet(np.ones(k))
    wf = [float(w) for w in weights]
    out = np.empty(p, np.float32)
    sum_bytes = (k * p + p) * 4
    copy_bytes = 2 * k * p * 4

    def memcpy():
        for x in xs:
            np.copyto(out, x)

    impls = [("memcpy", memcpy, copy_bytes, "")]
    if _core is not None:
        impls.append(("c", lambda: _core.weighted_sum(out, xs, weights), sum_bytes, ""))
    else:
        impls.append(("c", None, sum_bytes, _NO_CORE))
    impls.append(("numpy-naive", lambda: sum(w * x for w, x in zip(wf, xs)), sum_bytes, ""))

    runnable = [(name, fn) for name, fn, _, _ in impls if fn is not None]
    medians = dict(zip([name for name, _ in runnable],
                       time_medians([fn for _, fn in runnable], repeats)))
    memcpy_rate = copy_bytes / medians["memcpy"] / GB
    for name, fn, nbytes, note in impls:
        if fn is None:
            yield dict(base, impl=name, gb_per_s=None, median_s=None, repeats=0, note=note)
            continue
        t = medians[name]
        rate = nbytes / t / GB
        yield dict(base, impl=name, gb_per_s=round(rate, 2), median_s=round(t, 5),
                   repeats=repeats, vs_memcpy=round(rate / memcpy_rate, 2))


# ---------------------------------------------------------------------------------------
# registry: each entry yields row dicts. The training benchmark (local_train steps/s) is added
# here by its owner, e.g. `bench_training`; keep one function per benchmark.
# ---------------------------------------------------------------------------------------

BENCHMARKS: list[Callable[[argparse.Namespace], Iterator[dict]]] = [
    bench_aggregate,
    # bench_training,  <- the training benchmark goes here
]


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, fewer repeats")
    ap.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    ap.add_argument("--only", action="append", metavar="NAME",
                    help="run only this benchmark (repeatable): "
                         + ", ".join(b.__name__.removeprefix("bench_") for b in BENCHMARKS))
    ap.add_argument("--mem-budget-gb", type=float, default=6.0,
                    help="skip sizes whose buffers need more than this (default 6)")
    args = ap.parse_args(argv)
    chosen = [b for b in BENCHMARKS
              if not args.only or b.__name__.removeprefix("bench_") in args.only]
    if not chosen:
        ap.error(f"--only {args.only}: no such benchmark")
    rows = []
    for bench in chosen:
        for row in bench(args):
            rows.append(row)
            if not args.json:
                print(f"  {row}", file=sys.stderr, flush=True)
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
