#!/usr/bin/env python3
"""A secure round against a clear one at 10 clients x 975k parameters in process, in wall
and process CPU time, for whichever edgefl comes first on PYTHONPATH: to compare two
checkouts (say, before and after a change to secure aggregation), run it once per
checkout, alternating, each in its own process.

    PYTHONPATH=/path/to/checkout python tools/experiments/secagg_round_cost.py \\
        [--local epoch|step] [--repeats 7]

The round is tools/bench_privacy.py's "round, in process" row (FedAvg, digits MLP
[1000, 900], IID shards, one training thread, SecAgg on a complete graph, 32-bit ring):
after one warm-up each, the clear and the secure round interleaved; prints one JSON line
with the checkout's path, medians, and the medians [min, max] of the per-repeat ratios.
Unlike the benchmark it adds nothing to sys.path, so an older checkout's edgefl can be
measured with this file."""
from __future__ import annotations

import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"
os.environ["OMP_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local", choices=("epoch", "step"), default="epoch")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    if args.repeats < 1:     # (no _bench here: this script runs with an older checkout too)
        parser.error(f"--repeats {args.repeats}: need at least 1")

    import edgefl
    from edgefl.data import load_dataset, partition
    from edgefl.models import build_model
    from edgefl.privacy.settings import SecureAggregation
    from edgefl.runs.prepare import local_datasets
    from edgefl.sim import run_federation
    from edgefl.sim.secure import in_process_secure_sum
    from edgefl.strategies import Setup, get_strategy

    ds = load_dataset("digits")
    model = build_model({"name": "mlp", "hidden": [1000, 900]}, ds.input_shape, ds.num_classes)
    clients = local_datasets(ds, partition(ds, "iid", 10, 0), model)
    train = {"lr": 0.05, "batch_size": 32, "epochs": 1} if args.local == "epoch" else \
        {"lr": 0.05, "batch_size": 8, "steps": 1}
    setup = Setup(clients=sorted(clients), train=train, seed=0, rounds=1)
    init, strategy = model.init(0), get_strategy("fedavg")
    secure_sum = in_process_secure_sum(SecureAggregation(threshold=0.67, neighbours=0,
                                                         ring_bits=32, clip_range=1.0),
                                       "bench", 0)
    fns = [lambda: run_federation(strategy, init, clients, setup, 10, workers=1),
           lambda: run_federation(strategy, init, clients, setup, 10, workers=1, summing=True,
                                  secure_sum=secure_sum)]
    for fn in fns:
        fn()
    wall, cpu = [[], []], [[], []]
    for _ in range(args.repeats):
        for i, fn in enumerate(fns):
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall[i].append(time.perf_counter() - t0)
            cpu[i].append(time.process_time() - c0)

    def ratio(a, b):
        r = [x / y for x, y in zip(a, b)]
        return [round(statistics.median(r), 3), round(min(r), 3), round(max(r), 3)]

    print(json.dumps({"edgefl": os.path.dirname(edgefl.__file__), "local": args.local,
                      "clear_ms": round(statistics.median(wall[0]) * 1e3, 1),
                      "secure_ms": round(statistics.median(wall[1]) * 1e3, 1),
                      "clear_cpu_ms": round(statistics.median(cpu[0]) * 1e3, 1),
                      "secure_cpu_ms": round(statistics.median(cpu[1]) * 1e3, 1),
                      "ratio": ratio(wall[1], wall[0]), "cpu_ratio": ratio(cpu[1], cpu[0])}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
