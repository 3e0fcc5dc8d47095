#!/usr/bin/env python3
"""A round through a broker against the same round in process (issue 19, item 3).

(`--mode simulate` and `--mode million`: whole `edgefl simulate` processes against the plain
NumPy loop, and a million virtual clients; tools/_scale_sim.py says how.)

Run from a checkout with the extension built in place (or edgefl installed):
    python tools/bench_scale.py [--clients 100] [--per-round 10] [--rounds 10]
                                [--repeats 5] [--dataset fashion-mnist] [--json]
                                [--client-processes default|0|K[,...]]

Workload (issue 19's): softmax regression, IID over `--clients` clients, `--per-round` of
them a round, lr 0.1, batch 32, one local epoch. The data set is loaded and partitioned once;
each repeat then runs the whole federation in process (`sim.run_federation`, what
`edgefl simulate` runs) and then through a Mosquitto this tool starts on a free port with
the repo's broker/mosquitto.conf (`sim.run_over_broker`, what `edgefl simulate --transport
mqtt` runs: the aggregator in this process, every client with its own connection), once per
layout of `--client-processes` (the clients hosted in this process, or in K forked worker
processes). A run's round time is the median of its rounds'
`wall_s` after the first (which opens the connections' sessions); its period, the median
time from one round's model to the next one's (`on_model`, called as the round is closed in
process and once it is checkpointed over the broker: the aggregator's commit, checkpoint
and journal, which `wall_s` leaves out, are in it). The table gives, over the repeats, the
median and range of each layout's round time, of its period and of the same-repeat ratio of
periods (`ratio_*`; `ratio_wall` the median ratio of round times), the median wall time of a whole run (over the broker: connecting and closing every client
included) and, over the broker, of its rounds alone, the
peak PSS of this process and its children (the Mosquitto this tool started, which runs for
all repeats, is one of them, also in the in-process row), and how many rounds closed with every update ("all"). Every run must end with the
in-process model (checked).
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: one GEMM thread a client
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))                          # a source checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import PeakPss, children, cpu_seconds, markdown, need_counts    # noqa: E402

from edgefl import kernels, sim    # noqa: E402
from edgefl.runconfig import load_run_config    # noqa: E402
from edgefl.runs.prepare import prepare_run    # noqa: E402
from edgefl.transport.broker import (adapt_mosquitto_conf, find_mosquitto, free_port,    # noqa: E402
                                     probe)


def config_file(where: str, args) -> str:
    path = os.path.join(where, "run.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        dataset = {"name": args.dataset}
        if args.limit_test is not None:
            dataset["limit_test"] = args.limit_test
        json.dump({"dataset": dataset,
                   "partition": {"name": "iid", "clients": args.clients},
                   "model": {"name": "softmax"}, "strategy": {"name": "fedavg"},
                   "train": {"lr": 0.1, "batch_size": 32, "epochs": 1},
                   "rounds": args.rounds, "clients_per_round": args.per_round, "seed": 0,
                   "eval_every": 1}, fh)      # JSON is YAML; evaluated every round, as simulate does by default
    return path


class Mosquitto:
    """The repo's broker/mosquitto.conf on a free port, in a scratch directory."""

    def __init__(self, workdir: str):
        self.port = free_port()
        conf = os.path.join(workdir, "mosquitto.conf")
        with open(conf, "w", encoding="utf-8") as fh:
            fh.write(adapt_mosquitto_conf((REPO / "broker" / "mosquitto.conf").read_text(),
                                          self.port, workdir))
        self.log = open(os.path.join(workdir, "mosquitto.log"), "wb")
        self.proc = subprocess.Popen([find_mosquitto(), "-c", conf], stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not probe("127.0.0.1", self.port, timeout=0.5, any_answer=True):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mosquitto on port {self.port} did not start")
            time.sleep(0.02)
        self.url = f"mqtt://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


def round_s(history: list) -> float:
    rest = history[1:] or history
    return statistics.median(h["wall_s"] for h in rest)


class Periods:
    """on_model(round, model) of a run: when each round's model came; `median` of the
    times between consecutive rounds' models (so round 1 is left out)."""

    def __init__(self):
        self.at: list = []

    def __call__(self, r, model) -> None:
        self.at.append(time.perf_counter())

    @property
    def median(self) -> float:
        gaps = [b - a for a, b in zip(self.at, self.at[1:])]
        return statistics.median(gaps) if gaps else float("nan")


class CpuMeter:
    """CPU time per round of each part of a run (`--cpu`; Linux /proc): this process's
    threads by name (a pool's numbered threads together), its worker processes (children
    other than the broker and the memory sampler), the broker and the sampler, between the
    model of round 1 and that of the last round. Read only at those two calls, so the run
    itself is not slowed."""

    def __init__(self, last_round: int, broker_pid: int | None,
                 sampler_pid: int | None = None):
        self.last_round, self.broker_pid, self.sampler_pid = last_round, broker_pid, sampler_pid
        self._first = self._last = None

    def __call__(self, r, model) -> None:
        if r == 1:
            self._first = self._snapshot()
        elif r == self.last_round:
            self._last = self._snapshot()

    def _snapshot(self) -> tuple:
        me = os.getpid()
        names = {t.native_id: t.name for t in threading.enumerate()}
        parts: dict = {}
        for tid, seconds in _thread_cpu(me).items():
            name = names.get(tid, "other threads")
            name = name.rstrip("0123456789").rstrip("_") if name[-1:].isdigit() else name
            name = re.sub(r"-sim-[0-9a-f]+-", "-sim-", name)    # a run's federation id
            parts[f"this process: {name}"] = parts.get(f"this process: {name}", 0.0) + seconds
        for child in children(me):
            part = "broker" if child == self.broker_pid else \
                "the tool's memory sampler" if child == self.sampler_pid else "worker processes"
            parts[part] = parts.get(part, 0.0) + sum(_thread_cpu(child).values())
        return time.perf_counter(), parts

    def per_round(self) -> dict:
        """{part: ms of CPU a round}, "total" included; {} when the run had < 2 rounds."""
        if self._first is None or self._last is None:
            return {}
        rounds = self.last_round - 1
        (_, a), (_, b) = self._first, self._last
        out = {k: round((v - a.get(k, 0.0)) * 1e3 / rounds, 2) for k, v in b.items()}
        out = {k: v for k, v in out.items() if v > 0}
        out["total"] = round(sum(out.values()), 2)
        return out


def _thread_cpu(pid: int) -> dict:
    """{thread id: seconds of user + system CPU} of process `pid` ({} if it is gone)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return {}
    seconds = {tid: cpu_seconds(pid, tid) for tid in tids}
    return {tid: s for tid, s in seconds.items() if s is not None}


def both(period: "Periods", meter: CpuMeter, with_cpu: bool):
    """The on_model of a run: its period, and with --cpu its CPU meter."""
    if not with_cpu:
        return period

    def on_model(r, model):
        period(r, model)
        meter(r, model)
    return on_model


def cpu_rows(cpu: dict, names: dict) -> list:
    """--cpu's table: a row per part, a column per layout, medians over the repeats."""
    columns = {"in process": "in process", **{k: names[k] for k in names}}
    parts = sorted({p for runs in cpu.values() for run in runs for p in run},
                   key=lambda p: (p == "total", p))
    rows = []
    for part in parts:
        row = {"part (ms of CPU a round)": part}
        for key, label in columns.items():
            values = [run.get(part, 0.0) for run in cpu[key] if run]
            row[label] = round(statistics.median(values), 2) if values else ""
        rows.append(row)
    return rows


def span(values: list, digits: int = 4) -> dict:
    return {"median": round(statistics.median(values), digits),
            "min": round(min(values), digits), "max": round(max(values), digits)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--limit-test", type=int, default=None, metavar="N",
                        help="evaluate on the first N test images only (both layouts): how "
                             "the ratio moves when work both layouts share gets cheaper")
    parser.add_argument("--client-processes", default="default",
                        help="comma-separated layouts of the clients over the broker, each "
                             "a row: 0 (hosted in the simulating process), K (K forked worker "
                             "processes), or 'default' (run_over_broker's choice)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--cpu", action="store_true",
                        help="also the CPU time a round costs, by thread and process (Linux)")
    # issue 19 items 1-2: whole `edgefl simulate` processes against tools/plain_loop.py
    parser.add_argument("--mode", choices=("broker", "simulate", "million"), default="broker",
                        help="broker: a round over Mosquitto vs in process (default); "
                             "simulate / million: see tools/_scale_sim.py")
    parser.add_argument("--before", metavar="CHECKOUT",
                        help="--mode simulate: also run this checkout's edgefl simulate")
    parser.add_argument("--outputs", action="store_true",
                        help="--mode simulate: also run simulate with curves.png and model.onnx")
    parser.add_argument("--only", action="append", choices=("100", "1000", "10000"),
                        help="--mode simulate: only this workload (by clients; repeatable)")
    args = parser.parse_args(argv)
    need_counts(parser, args, "clients", "per_round", "rounds", "repeats", "workers")
    if args.per_round > args.clients:
        parser.error(f"--per-round {args.per_round}: more than the {args.clients} clients")
    simulate_only = [f"--{n}" for n in ("before", "outputs", "only") if getattr(args, n)]
    if simulate_only and args.mode != "simulate":
        # silently ignored before: a "before" row that was never measured
        parser.error(f"{', '.join(simulate_only)}: for --mode simulate, not --mode {args.mode}")
    if args.before is not None and not os.path.isfile(
            os.path.join(args.before, "edgefl", "__init__.py")):
        # else the "before" run imports whatever edgefl the environment has, and says so not
        parser.error(f"--before {args.before}: not a checkout of edgefl (no "
                     f"{os.path.join(args.before, 'edgefl', '__init__.py')})")
    if args.limit_test is not None:
        if args.mode != "broker":
            parser.error(f"--limit-test is for --mode broker (the round over Mosquitto against "
                         f"in process), not --mode {args.mode}")
        if args.limit_test < 1:
            parser.error(f"--limit-test {args.limit_test}: need a positive number of test images")
    if args.mode != "broker":
        import _scale_sim
        return _scale_sim.main(args)
    if find_mosquitto() is None:
        parser.error("needs the mosquitto binary (apt-get install mosquitto)")

    layouts = []
    for item in args.client_processes.split(","):
        item = item.strip()
        try:
            layouts.append(None if item == "default" else int(item))
        except ValueError:
            parser.error(f"--client-processes {args.client_processes!r}: {item!r} is not "
                         "'default' or a number of processes")
    scratch = tempfile.TemporaryDirectory(prefix="edgefl-bench-scale-")
    run = prepare_run(load_run_config(config_file(scratch.name, args)), workers=args.workers,
                      progress=False)
    broker = Mosquitto(scratch.name)
    sampler = PeakPss()
    inproc, inproc_wall, inproc_mem, inproc_period = [], [], [], []
    mqtt = {k: [] for k in range(len(layouts))}
    periods = {k: [] for k in range(len(layouts))}
    ratios = {k: [] for k in range(len(layouts))}
    ratios_wall = {k: [] for k in range(len(layouts))}
    walls = {k: [] for k in range(len(layouts))}
    in_rounds = {k: [] for k in range(len(layouts))}
    mems = {k: [] for k in range(len(layouts))}
    closed = {k: [0, 0] for k in range(len(layouts))}
    cpu = {k: [] for k in ["in process", *range(len(layouts))]}   # per repeat: {part: ms}
    names = {}
    try:
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            period = Periods()
            meter = CpuMeter(args.rounds, broker.proc.pid, sampler.pid)
            with sampler.measure() as mem:
                a = sim.run_federation(run.strategy, run.init_params, run.clients, run.setup,
                                       args.per_round, workers=args.workers,
                                       test=(run.dataset.x_test, run.dataset.y_test),
                                       eval_every=1, on_model=both(period, meter, args.cpu))
            cpu["in process"].append(meter.per_round())
            inproc_wall.append(time.perf_counter() - t0)
            inproc_mem.append(mem.peak)
            inproc.append(round_s(a.history))
            inproc_period.append(period.median)
            for k, processes in enumerate(layouts):
                t0 = time.perf_counter()
                period = Periods()
                meter = CpuMeter(args.rounds, broker.proc.pid, sampler.pid)
                with sampler.measure() as mem:
                    b, info = sim.run_over_broker(run, broker.url, workers=args.workers,
                                                  client_processes=processes,
                                                  on_model=both(period, meter, args.cpu))
                cpu[k].append(meter.per_round())
                walls[k].append(time.perf_counter() - t0)
                in_rounds[k].append(sum(h["wall_s"] for h in b.history))
                mems[k].append(mem.peak)
                closed[k][0] += sum(h["closed_by"] == "all" for h in b.history)
                closed[k][1] += len(b.history)
                if a.model_sha256 != b.model_sha256:
                    raise SystemExit(f"the runs ended with different models: "
                                     f"{a.model_sha256} in process, {b.model_sha256} over the "
                                     f"broker ({info['client_processes']} client processes)")
                n = info["client_processes"]
                names[k] = ("over Mosquitto, clients in the simulating process" if n == 0
                            else f"over Mosquitto, clients in {n} worker process"
                                 f"{'es' if n > 1 else ''}")
                mqtt[k].append(round_s(b.history))
                periods[k].append(period.median)
                ratios[k].append(periods[k][-1] / inproc_period[-1])
                ratios_wall[k].append(mqtt[k][-1] / inproc[-1])
    finally:
        sampler.close()
        broker.stop()
        scratch.cleanup()
    rows = [{"layout": "in process", **{f"round_ms_{k}": round(v * 1e3, 2)
                                         for k, v in span(inproc).items()},
             **{f"period_ms_{k}": round(v * 1e3, 2) for k, v in span(inproc_period).items()},
             "run_s_median": round(statistics.median(inproc_wall), 2),
             "peak_pss_mb": round(max(inproc_mem) / 2 ** 20)}]
    for k in range(len(layouts)):
        rows.append({"layout": names[k], **{f"round_ms_{q}": round(v * 1e3, 2)
                                            for q, v in span(mqtt[k]).items()},
                     **{f"period_ms_{q}": round(v * 1e3, 2)
                        for q, v in span(periods[k]).items()},
                     **{f"ratio_{q}": v for q, v in span(ratios[k], 2).items()},
                     "ratio_wall": round(statistics.median(ratios_wall[k]), 2),
                     "run_s_median": round(statistics.median(walls[k]), 2),
                     "rounds_s_median": round(statistics.median(in_rounds[k]), 2),
                     "peak_pss_mb": round(max(mems[k]) / 2 ** 20),
                     "closed_all": f"{closed[k][0]}/{closed[k][1]}"})
    meta = {"backend": kernels.backend, "dataset": args.dataset, "clients": args.clients,
            "per_round": args.per_round, "rounds": args.rounds, "repeats": args.repeats,
            "workers": args.workers, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "client_processes": args.client_processes, "limit_test": args.limit_test,
            "target_ratio": 2.0}
    extra = {"cpu": cpu_rows(cpu, names)} if args.cpu else {}
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows, **extra}, indent=1))
    else:
        tested = "" if args.limit_test is None else \
            f", evaluated on {args.limit_test} test images"
        print(f"# a round over Mosquitto vs in process ({args.dataset}{tested}, softmax, "
              f"{args.clients} clients, {args.per_round} a round, {args.rounds} rounds; "
              f"{args.repeats} interleaved repeats; backend {kernels.backend}; {meta['date']})\n")
        print(markdown(rows))
        if args.cpu:
            print(f"\nCPU time a round, rounds 2-{args.rounds}, by part; medians over the "
                  f"repeats (/proc: 10 ms ticks, so run 60+ rounds):\n")
            print(markdown(extra["cpu"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
