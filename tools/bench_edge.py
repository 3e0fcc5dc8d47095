"""Two levels against flat: for each strategy that runs over edge aggregators, the largest
difference between the final model of a two-level run and the flat in-process run of the
same config, and the two-level run's wall time (docs/scaling.md "Two levels").

Each strategy gets three fresh Mosquitto processes on loopback -- a centre and two sites
bridged to it with the repo's broker/bridge-site.conf -- and the central aggregator, one
edge aggregator per site and one client per shard as threads (tests/test_edge.py's
harness, `two_level_run`). Needs the `mosquitto` binary.

    python tools/bench_edge.py                      # the table in docs/scaling.md
    python tools/bench_edge.py --clients 16 --per-round 12 --rounds 10 --json

`--capacity` (issue 19 item 5): one centre and --sites sites, --clients `edgefl client`
processes, every client each round; the capacity model of docs/scaling.md ("Capacity")
next to the central Mosquitto's own byte counters, round times and every process's CPU:

    python tools/bench_edge.py --capacity --sites 4 --clients 100 --rounds 5 --rows 1000 \\
        --model '{name: mlp, hidden: [1000, 1000]}'
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
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
    parser.add_argument("--model", default="softmax",
                        help="with --capacity: the run config's model, a name or a YAML "
                             "mapping, e.g. '{name: mlp, hidden: [1000, 1000]}' (1.08M "
                             "parameters on digits)")
    parser.add_argument("--clients-as", choices=("processes", "threads"), default="processes",
                        help="with --capacity: `edgefl client` processes or threads here")
    parser.add_argument("--rows", type=int, default=300,
                        help="with --capacity: digits training rows over all clients")
    parser.add_argument("--round-timeout", type=float, default=300.0)
    parser.add_argument("--limit", type=float, default=900.0,
                        help="with --capacity: seconds before every role is stopped")
    args = parser.parse_args(argv)
    from _bench import need_counts
    need_counts(parser, args, "clients", "per_round", "sites", "rows")
    if args.per_round > args.clients and not args.capacity:     # (--capacity: every client)
        parser.error(f"--per-round {args.per_round}: more than the {args.clients} clients")
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
    """One fedavg two-level run, every client selected each round (issue 19 item 5): the
    capacity model of docs/scaling.md next to what was measured. Bytes at the centre are
    counted by the central Mosquitto itself ($SYS/broker/bytes/received and /sent, read
    before and after the run), not computed; the clients are `edgefl client` processes
    (--clients-as processes, the default) or threads in this process."""
    import statistics

    from _bench import markdown
    from edgefl.config import load_yaml
    from edgefl.runconfig import load_run_config
    from edgefl.runs.prepare import prepare_run
    from edgefl.sim.loop import run_federation
    from helpers import SMALL_RUN, write_run_yaml
    from test_edge import Broker, _wait_bridge, site_bridge, two_level_run

    model = load_yaml(args.model)
    model = {"name": model} if isinstance(model, str) else model
    if not isinstance(model, dict) or "name" not in model:
        raise SystemExit(f"--model {args.model!r}: a model name or a YAML mapping with a name")
    e, k, r = args.sites, args.clients, args.rounds
    if k < e or r < 2:
        raise SystemExit("--capacity needs at least one client per site and 2 rounds "
                         "(round 1 carries the start-up and is reported apart)")
    with tempfile.TemporaryDirectory(prefix="edgefl-bench-cap-") as tmp:
        tmp = Path(tmp)
        run_path = write_run_yaml(tmp, SMALL_RUN, model=model, rounds=r,
                                  clients_per_round=k,
                                  partition={"name": "iid", "clients": k},
                                  dataset={"name": "digits", "limit_train": args.rows})
        run = prepare_run(load_run_config(run_path), progress=False)
        size = int(run.init_params.size)
        # the cost of local training alone: the same rounds in process on one thread
        flat = run_federation(run.strategy, run.init_params, run.clients, run.setup,
                              clients_per_round=k, workers=1, rounds=2)
        train_s = flat.history[-1]["wall_s"] / k
        run = prepare_run(load_run_config(run_path), progress=False)
        # $SYS every second: the counters are read before and after the run
        central = Broker(tmp / "central", "sys_interval 1\n")
        central.start()
        sites, procs = {}, []
        names = [f"site-{i}" for i in range(e)]
        edge_of = (lambda i: names[i * e // k])
        try:
            for edge in names:
                sites[edge] = Broker(tmp / edge, site_bridge("fed", edge, central.port))
                sites[edge].start()
            for edge, broker in sites.items():
                _wait_bridge(central, broker, edge)
            if args.clients_as == "processes":
                procs = _client_processes(tmp, run_path, k, lambda i: sites[edge_of(i)].url)
                # the run starts once every client is up: its start-up is not a round's
                _wait_online([b.url for b in sites.values()], k, procs, tmp)
            sampler = _Sampler([p.pid for p in procs],
                               [b.proc.pid for b in [central, *sites.values()]])
            before = _sys_bytes(central.url)
            cpu0, t0 = time.process_time(), time.perf_counter()
            result, _ = two_level_run(run, central, sites, str(tmp / "state"), edge_of=edge_of,
                                      round_timeout_s=args.round_timeout, limit_s=args.limit,
                                      client_threads=args.clients_as == "threads")
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            for proc in procs:
                if proc.wait(60) != 0:
                    raise SystemExit(f"a client exited {proc.returncode}: "
                                     + (tmp / "logs" / f"{proc.pid}.log").read_text()[-2000:])
            sampler.stop()
            after = _sys_bytes(central.url)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
            for broker in list(sites.values()) + [central]:
                broker.stop()
    if not result.finished:
        raise SystemExit("the two-level run did not finish")
    frame = 4 * size
    received = (after["received"] - before["received"]) / r
    sent = (after["sent"] - before["sent"]) / r
    walls = [rec["wall_s"] for rec in result.history]
    later = statistics.median(walls[1:])
    cores = os.cpu_count() or 1
    predicted_round = k * train_s / cores
    # every role's CPU in a round, spread over the cores: the round time if nothing waits
    # rounds 2..R (round 1 opens every connection's session): CPU between their records
    ends = [t0 + rec["elapsed_s"] for rec in result.history]
    roles_cpu, client_cpu, broker_cpu = (c / (r - 1)
                                         for c in sampler.cpu_between(ends[0], ends[-1]))
    # every process's CPU in a round, spread over the cores: the round time if nothing waits
    cpu_round = (roles_cpu + client_cpu + broker_cpu) / cores
    rows = [
        {"quantity": "parameters P (model)", "model": f"{size:,} ({args.model})",
         "measured": ""},
        {"quantity": "centre broker bytes received / round",
         "model": f"(E+1)*4P = {_si((e + 1) * frame)}", "measured": _si(received)},
        {"quantity": "centre broker bytes sent / round",
         "model": f"2E*4P = {_si(2 * e * frame)}", "measured": _si(sent)},
        {"quantity": "the same, flat (every client at the centre)",
         "model": f"(K+1)*4P = {_si((k + 1) * frame)} in, 2K*4P = {_si(2 * k * frame)} out",
         "measured": "(not run)"},
        {"quantity": "round wall s (rounds 2..R, median)",
         "model": f">= K*t_train/cores = {k}*{train_s * 1e3:.2f} ms/{cores} = "
                  f"{predicted_round:.3f}",
         "measured": f"{later:.3f} [{min(walls[1:]):.3f}, {max(walls[1:]):.3f}]"},
        {"quantity": "round wall s if CPU-bound: (all CPU / round) / cores",
         "model": f"{cpu_round:.3f}", "measured": ""},
        {"quantity": "round 1 wall s", "model": "", "measured": f"{walls[0]:.3f}"},
        {"quantity": "rounds / hour",
         "model": f"<= {3600 / max(predicted_round, 1e-9):,.0f} (training), "
                  + (f"{3600 / cpu_round:,.0f} (CPU)" if cpu_round
                     else "(rounds too short to sample CPU)"),
         "measured": f"{3600 / later:,.0f}"},
        {"quantity": "CPU s / round 2..R, centre + edges (this process)", "model": "",
         "measured": f"{roles_cpu:.3f}" + (" (clients too)" if not procs else "")},
        {"quantity": "CPU s / round 2..R, all clients", "model":
         f"K*t_train = {k * train_s:.3f}", "measured": f"{client_cpu:.3f}"
         if procs else "(threads: in the line above)"},
        {"quantity": "CPU s / round 2..R, the 1 + E Mosquittos", "model": "",
         "measured": f"{broker_cpu:.3f}"},
        {"quantity": "CPU s / round 2..R, all", "model": "", "measured":
         f"{roles_cpu + client_cpu + broker_cpu:.3f} on {cores} cores"},
        {"quantity": f"clients ({args.clients_as}), per site", "model": "",
         "measured": f"{k} ({k // e} per site, {e} sites)"},
    ]
    if procs:
        rows.append({"quantity": "client process peak RSS MiB: largest, all (sum RSS / "
                                 "sum PSS)", "model": "",
                     "measured": f"{sampler.rss_max / 2**20:.0f}, "
                                 f"{sampler.rss_sum / 2**20:.0f} / "
                                 f"{sampler.pss_sum / 2**20:.0f}"})
    rows.append({"quantity": "whole run wall s / CPU s of this process", "model": "",
                 "measured": f"{wall:.2f} / {cpu:.2f}"})
    out = {"sites": e, "clients": k, "clients_as": args.clients_as, "rounds": r,
           "parameters": size, "model": model, "rows_per_client": args.rows / k,
           "centre_bytes_received_per_round": received, "centre_bytes_sent_per_round": sent,
           "predicted_received": (e + 1) * frame, "predicted_sent": 2 * e * frame,
           "round_wall_s": walls, "train_s_per_client": train_s,
           "client_cpu_s_per_round": client_cpu if procs else None,
           "roles_cpu_s_per_round": roles_cpu, "broker_cpu_s_per_round": broker_cpu,
           "client_max_rss_mib": sampler.rss_max / 2**20 if procs else None,
           "clients_rss_sum_mib": sampler.rss_sum / 2**20,
           "clients_pss_sum_mib": sampler.pss_sum / 2**20,
           "wall_s": wall, "cpu_s": cpu}
    print(json.dumps(out, indent=1) if args.json else markdown(rows))
    return 0


def _si(n: float) -> str:
    return f"{n / 1e6:.3f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _sys_bytes(url: str) -> dict:
    """The broker's $SYS/broker/bytes/{received,sent} (totals since it started), read once
    the broker has published them again after what came before (sys_interval 1)."""
    from edgefl.transport.mqtt import MqttTransport

    time.sleep(1.5)
    probe = MqttTransport(url, f"sys-probe-{time.monotonic_ns()}", clean_session=True)
    probe.connect()
    try:
        probe.subscribe("$SYS/broker/bytes/+", qos=0)
        seen, deadline = {}, time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:
            item = probe.receive(0.5)
            if getattr(item, "payload", None) and item.topic.startswith("$SYS/"):
                seen[item.topic.rsplit("/", 1)[1]] = int(item.payload)
    finally:
        probe.close()
    if set(seen) != {"received", "sent"}:
        raise SystemExit(f"the central broker published no $SYS byte counters ({seen})")
    return seen


def _wait_online(urls, k: int, procs, tmp: Path, timeout: float = 600.0) -> None:
    """Until every client's retained status at its site broker says online."""
    from edgefl.transport.mqtt import MqttTransport

    probes = [MqttTransport(url, f"online-probe-{i}", clean_session=True)
              for i, url in enumerate(urls)]
    online, deadline = set(), time.monotonic() + timeout
    try:
        for probe in probes:
            probe.connect()
            probe.subscribe("edgefl/fed/status/+", qos=1)
        while len(online) < k:
            if time.monotonic() > deadline:
                raise SystemExit(f"{len(online)} of {k} clients online after {timeout:.0f} s")
            for proc in procs:
                if proc.poll() is not None:
                    raise SystemExit(f"a client exited {proc.returncode}: " + (
                        tmp / "logs" / f"{proc.pid}.log").read_text()[-2000:])
            for probe in probes:
                item = probe.receive(0.05)
                if getattr(item, "payload", None):
                    node = item.topic.rsplit("/", 1)[1]
                    if json.loads(item.payload).get("online"):
                        online.add(node)
                    else:
                        online.discard(node)
    finally:
        for probe in probes:
            probe.close()


def _client_processes(tmp: Path, run_path: str, k: int, url_of) -> list:
    """k `edgefl client --partition RUN --shard i` processes, client i on url_of(i)."""
    import yaml

    from edgefl.roles import default_client_ids

    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    (tmp / "logs").mkdir()
    procs = []
    for i, node in enumerate(default_client_ids(k)):
        site = tmp / f"{node}.yaml"
        site.write_text(yaml.safe_dump({"profile": "generic-x86",
                                   "node": {"id": node, "federation": "fed"},
                                   "state_dir": str(tmp / f"{node}-state"),
                                   "broker": {"url": url_of(i)}, "log": {"level": "warning"}}))
        log = tmp / "logs" / f"{i}.log"
        with open(log, "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "edgefl.cli", "client", "--config", str(site),
                 "--partition", run_path, "--shard", str(i), "--exit-when-finished"],
                cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT))
        log.rename(tmp / "logs" / f"{procs[-1].pid}.log")
    return procs


class _Sampler:
    """Every 0.2 s: the CPU of this process, of the client processes and of the brokers
    (utime + stime from /proc/PID/stat); every second, the largest RSS of one client and the largest sums of
    their RSS and PSS (/proc/PID/smaps_rollup) seen. (Not ru_maxrss: a child started by
    vfork carries this process's peak in it.)"""

    def __init__(self, pids, brokers):
        self.pids, self.brokers, self.samples = list(pids), list(brokers), []
        self.rss_max = self.rss_sum = self.pss_sum = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _cpu(self, pids) -> float:
        from _bench import cpu_seconds
        # a process waited for is gone: its CPU is final (counted before it went)
        return sum(cpu_seconds(pid) or 0.0 for pid in pids)

    def _memory(self) -> None:
        rss_sum = pss_sum = 0
        from _bench import memory_of
        for pid in self.pids:
            memory = memory_of(pid)
            if memory is None:
                continue                          # exited
            rss, pss = memory
            self.rss_max = max(self.rss_max, rss)
            rss_sum, pss_sum = rss_sum + rss, pss_sum + pss
        self.rss_sum, self.pss_sum = max(self.rss_sum, rss_sum), max(self.pss_sum, pss_sum)

    def _run(self):
        n = 0
        while not self._stop.wait(0.2):
            self.samples.append((time.perf_counter(), time.process_time(),
                                 self._cpu(self.pids), self._cpu(self.brokers)))
            n += 1
            if self.pids and n % 5 == 0:
                self._memory()

    def cpu_between(self, t_from: float, t_to: float) -> tuple[float, float, float]:
        """(this process's, the clients', the brokers') CPU seconds between two
        perf_counter times, from the samples nearest them."""
        def at(t):
            return min(self.samples, key=lambda s: abs(s[0] - t))
        a, b = at(t_from), at(t_to)
        return b[1] - a[1], b[2] - a[2], b[3] - a[3]

    def stop(self):
        self._stop.set()
        self._thread.join(5)


if __name__ == "__main__":
    sys.exit(main())
