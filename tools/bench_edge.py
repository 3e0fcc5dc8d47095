"""Two levels against flat: for each strategy that runs over edge aggregators, the largest
difference between the final model of a two-level run and the flat in-process run of the
same config, and the two-level run's wall time (docs/scaling.md "Two levels").

Each strategy gets three fresh Mosquitto processes on loopback -- a centre and two sites
bridged to it with the repo's broker/bridge-site.conf -- and the central aggregator, one
edge aggregator per site and one client per shard as threads (tests/test_edge.py's
harness, `two_level_run`). Needs the `mosquitto` binary.

    python tools/bench_edge.py                      # the table in docs/scaling.md
    python tools/bench_edge.py --clients 16 --per-round 12 --rounds 10 --json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))                          # a source checkout
sys.path.insert(0, str(REPO / "tests"))                # the two-level harness
sys.path.insert(0, str(REPO / "tools"))

STRATEGIES = {"fedavg": {}, "fedprox": {}, "fednova": {}, "mfl": {"gamma": 0.5},
              "fedumf": {}, "fedadam": {"eta": 0.05}, "fedyogi": {"eta": 0.05},
              "fedavgm": {}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8, help="boards (half at each site)")
    parser.add_argument("--per-round", type=int, default=6, help="clients per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help="comma-separated (default: every one edges serve)")
    parser.add_argument("--json", action="store_true", help="print JSON rows, not a table")
    parser.add_argument("--capacity", action="store_true",
                        help="one centre and --sites sites, every client each round: round "
                             "time, process CPU per round, bytes at the centre")
    parser.add_argument("--sites", type=int, default=4, help="sites with --capacity")
    args = parser.parse_args(argv)
    if args.capacity:
        return capacity(args)

    import numpy as np

    from _bench import markdown
    from edgefl.runs.prepare import prepare_run
    from helpers import load_small_run
    from test_edge import Broker, _wait_bridge, flat_params, site_bridge, two_level_run

    rows = []
    for name in args.strategies.split(","):
        with tempfile.TemporaryDirectory(prefix="edgefl-bench-edge-") as tmp:
            tmp = Path(tmp)
            central = Broker(tmp / "central")
            central.start()
            sites = {}
            try:
                for edge in ("site-a", "site-b"):
                    sites[edge] = Broker(tmp / edge, site_bridge("fed", edge, central.port))
                    sites[edge].start()
                for edge, broker in sites.items():
                    _wait_bridge(central, broker, edge)
                config = load_small_run(tmp, partition={"name": "iid",
                                                        "clients": args.clients},
                                        strategy={"name": name, **STRATEGIES.get(name, {})},
                                        rounds=args.rounds, clients_per_round=args.per_round)
                flat = flat_params(prepare_run(config, progress=False))
                run = prepare_run(config, progress=False)
                t0 = time.perf_counter()
                result, _ = two_level_run(run, central, sites, str(tmp / "state"))
                wall = time.perf_counter() - t0
            finally:
                for broker in list(sites.values()) + [central]:
                    broker.stop()
        if not result.finished:
            raise SystemExit(f"{name}: the two-level run did not finish")
        rows.append({"strategy": name, "rounds": args.rounds,
                     "clients (per round)": f"{args.clients} ({args.per_round})",
                     "max abs(two-level - flat)":
                         f"{float(np.max(np.abs(result.params - flat))):.2e}",
                     "max abs(parameter)": f"{float(np.max(np.abs(flat))):.3f}",
                     "two-level wall s": f"{wall:.2f}"})
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0


def capacity(args) -> int:
    """One fedavg two-level run, every client selected each round (issue 19 item 5)."""
    from _bench import markdown
    from edgefl.runs.prepare import prepare_run
    from helpers import load_small_run
    from test_edge import Broker, _wait_bridge, site_bridge, two_level_run

    with tempfile.TemporaryDirectory(prefix="edgefl-bench-cap-") as tmp:
        tmp = Path(tmp)
        central = Broker(tmp / "central")
        central.start()
        sites = {}
        try:
            for i in range(args.sites):
                edge = f"site-{i}"
                sites[edge] = Broker(tmp / edge, site_bridge("fed", edge, central.port))
                sites[edge].start()
            for edge, broker in sites.items():
                _wait_bridge(central, broker, edge)
            config = load_small_run(tmp, partition={"name": "iid", "clients": args.clients},
                                    strategy={"name": "fedavg"}, rounds=args.rounds,
                                    clients_per_round=args.clients)
            run = prepare_run(config, progress=False)
            size = int(run.init_params.size)
            cpu0, t0 = time.process_time(), time.perf_counter()
            result, _ = two_level_run(run, central, sites, str(tmp / "state"),
                                      round_timeout_s=120.0, limit_s=600.0)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        finally:
            for broker in list(sites.values()) + [central]:
                broker.stop()
    if not result.finished:
        raise SystemExit("the two-level run did not finish")
    e, k, r = args.sites, args.clients, args.rounds
    rows = [{"sites": e, "clients (threads)": k, "per site": k // e, "rounds": r,
             "parameters P": size, "model frame KiB (4P)": round(4 * size / 1024, 1),
             "centre MiB/round two-level 2E*4P": round(2 * e * 4 * size / 2**20, 3),
             "centre MiB/round flat 2K*4P": round(2 * k * 4 * size / 2**20, 3),
             "wall s/round (incl. start-up)": round(wall / r, 2),
             "process CPU s/round": round(cpu / r, 2)}]
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
