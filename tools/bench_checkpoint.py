"""The aggregator's per-round checkpoint at growing history lengths (issue 19: fast at any
scale).

    python tools/bench_checkpoint.py [--records 10,100,1000] [--saves 30] [--repeats 3]
                                     [--before CHECKOUT] [--json]

After every round the aggregator saves its checkpoint (`AggregatorCheckpoint.save`): the
strategy's state and the run's history of round records. This times that save as the
aggregator makes it -- each save one record longer than the last, the previous record
amended with its evaluation, which comes in a round late -- after `--records` rounds, in
CPU time of the saving process (the save sits between a round's last update and the next
announcement, so its CPU is on every round's critical path). The records are shaped like a
round over a broker (the keys of `edgefl.rounds.round_record` and the aggregator's
extras, 10 clients selected), the model a 7,850-parameter softmax regression. Files go to
/dev/shm where there is one, as `run_over_broker`'s state does, so the disk's fsync is not
timed.

With `--before CHECKOUT` (another checkout of edgefl, e.g. a `git worktree` of the commit
before) the same is timed with that checkout's edgefl, in separate processes alternated
with this checkout's `--repeats` times; medians over all saves, with the range.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _bench import child_env, print_result  # noqa: E402

REPO = os.path.dirname(HERE)


def record(r: int) -> dict:
    """A round record as an aggregator over a broker writes it (not yet evaluated)."""
    return {"round": r, "test_accuracy": None, "test_loss": None,
            "train_loss": 0.5 + 1.0 / r, "uplink_bytes": 314_000, "downlink_bytes": 314_000,
            "selected": [(r * 7 + k * 13) % 100 for k in range(10)], "trained": 10,
            "wall_s": 0.0151 + r * 1e-6, "train_wall_s": 0.0012, "elapsed_s": 0.016 * r,
            "closed_by": "all", "updates": 10, "missing": [], "late": 0, "duplicates": 0,
            "rejected": 0, "resends": 0, "announcements": 1, "wire_up_bytes": 316_400,
            "wire_down_bytes": 316_400}


def worker(records: int, saves: int) -> list:
    """CPU seconds of each of `saves` saves after `records` rounds (this process's edgefl)."""
    import numpy as np

    from edgefl.roles.state import AggregatorCheckpoint
    from edgefl.strategies import State

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=base) as directory:
        state = State({"params": np.zeros(7850, np.float32)}, {})
        history = [dict(record(r), test_accuracy=0.8, test_loss=0.5)
                   for r in range(1, records + 1)]

        def checkpoint(rows):
            n = len(rows)
            return AggregatorCheckpoint("run", "fingerprint", n, list(range(1, n + 1)), state,
                                        {"name": "fedavg"}, {"seed": 0}, rows, 0.016 * n)

        checkpoint(history).save(directory)       # the run so far (a restart's first save)
        times = []
        for r in range(records + 1, records + saves + 1):
            history[-1].update(test_accuracy=0.8, test_loss=0.5)   # evaluated a round late
            history = history + [record(r)]
            start = time.process_time()
            checkpoint(history).save(directory)
            times.append(time.process_time() - start)
    return times


def measure(tree: str, records: int, saves: int, scratch: str) -> list:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                           str(records), str(saves)], env=child_env(scratch, tree),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench_checkpoint: the worker for {tree} ({records} records) "
                         f"failed:\n{done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", default="10,100,1000",
                        help="comma-separated history lengths (rounds already run)")
    parser.add_argument("--saves", type=int, default=30, help="saves timed per process")
    parser.add_argument("--repeats", type=int, default=3,
                        help="processes per checkout and length, alternated")
    parser.add_argument("--before", metavar="CHECKOUT", help="another checkout to compare")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--worker", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return 0
    try:
        lengths = [int(n) for n in args.records.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--records {args.records!r}: comma-separated whole numbers")
    if not lengths or min(lengths) < 1 or args.saves < 1 or args.repeats < 1:
        parser.error("--records, --saves and --repeats must be at least 1")
    trees = [("this checkout", REPO)]
    if args.before:
        before = os.path.abspath(args.before)
        if not os.path.isfile(os.path.join(before, "edgefl", "roles", "state.py")):
            parser.error(f"--before {args.before}: no edgefl checkout there "
                         f"(edgefl/roles/state.py missing)")
        trees.append(("before", before))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as scratch:
        for n in lengths:
            times = {name: [] for name, _ in trees}
            for _ in range(args.repeats):
                for name, tree in trees:
                    times[name] += measure(tree, n, args.saves, scratch)
            for name, _ in trees:
                ms = sorted(t * 1e3 for t in times[name])
                rows.append({"checkout": name, "records": n, "saves": len(ms),
                             "save_cpu_ms_median": round(statistics.median(ms), 3),
                             "save_cpu_ms_min": round(ms[0], 3),
                             "save_cpu_ms_max": round(ms[-1], 3)})
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "before": args.before,
            "cpu_clock": "time.process_time of the saving process"}
    print_result(meta, rows, f"the aggregator's checkpoint save, CPU per round "
                             f"({meta['date']}, load {meta['load_avg'][0]:.2f})", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
