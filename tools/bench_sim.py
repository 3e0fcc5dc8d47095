#!/usr/bin/env python3
"""Simulation overhead: how much of a round `edgefl simulate` spends outside local training.

Run from a checkout with the extension built in place (or edgefl installed):
    python tools/bench_sim.py [--repeats N] [--json]

Workload (issue #3's target: "with 10 clients on digits, time outside local_train <= 10% of
a round"): the shipped quickstart config (digits, IID over 10 clients, MLP 64, 5 local
epochs, FedAvg, 20 rounds) with all 10 clients selected every round, test-set evaluation
every round, as `edgefl simulate quickstart --set clients_per_round=10` runs it.

Two measures, each the median over the repeats of whole 20-round runs:
    threads=2 (simulate's default here: one client thread per core)
        round_ms      median wall time of a round
        outside_frac  1 - (time the round spends in its parallel phase) / round: the serial
                      part, when at most one core works: selection, configure (per-client
                      train configs and seeds), aggregation, bookkeeping on the aggregator's
                      thread -- simulate's `summary.json` "overhead_fraction". The parallel
                      phase trains the clients and, as one more work item, evaluates the
                      previous round's model (run_federation defers it there)
    threads=1 (strict: everything on one thread)
        outside_frac  1 - (time inside the backend's local_train calls) / round: also counts
                      each client's Python around its kernel call (task, argument checks,
                      copies, the Update)
"""
from __future__ import annotations

import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before numpy: the C core's GEMMs on one thread
os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a source checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import need_counts, print_result    # noqa: E402

from edgefl import kernels, sim    # noqa: E402
from edgefl.runconfig import load_run_config    # noqa: E402
from edgefl.runs.prepare import prepare_run    # noqa: E402


def run_once(run, workers: int, inside: list) -> tuple[float, float, int]:
    """(round wall, parallel-phase wall) sums of one 20-round run, and its rounds."""
    inside[0] = 0.0
    result = sim.run_federation(run.strategy, run.init_params, run.clients, run.setup,
                                len(run.setup.clients), workers=workers,
                                test=(run.dataset.x_test, run.dataset.y_test))
    h = result.history
    return sum(r["wall_s"] for r in h), sum(r["train_wall_s"] for r in h), len(h)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="runs per measure (default 7)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    need_counts(parser, args, "repeats")

    config = load_run_config("quickstart")
    run = prepare_run(config, workers=2, progress=False)

    # time inside the backend's kernel call (after kernels.py's checks), for the strict
    # single-thread measure
    inside = [0.0]
    real_local_train = kernels.impl.local_train

    def timed_local_train(*a, **k):
        t = time.perf_counter()
        try:
            return real_local_train(*a, **k)
        finally:
            inside[0] += time.perf_counter() - t

    rows = []
    for workers in (2, 1):
        kernels.impl.local_train = timed_local_train if workers == 1 else real_local_train
        run_once(run, workers, inside)                      # warm-up
        fracs, rounds_ms = [], []
        for _ in range(args.repeats):
            wall, phase, n = run_once(run, workers, inside)
            used = inside[0] if workers == 1 else phase
            fracs.append(1.0 - used / wall)
            rounds_ms.append(wall / n * 1e3)
        rows.append({"threads": workers,
                     "measure": "outside the parallel phase" if workers > 1
                     else "outside local_train calls",
                     "round_ms": round(statistics.median(rounds_ms), 3),
                     "outside_frac": round(statistics.median(fracs), 4),
                     "target": 0.10})
    kernels.impl.local_train = real_local_train
    meta = {"backend": kernels.backend, "config": "quickstart, clients_per_round=10",
            "repeats": args.repeats}
    print_result(meta, rows, f"simulation overhead ({meta['config']}; backend "
                             f"{meta['backend']}; median of {args.repeats} runs of 20 rounds)",
                 args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
