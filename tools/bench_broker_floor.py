"""The CPU a round over Mosquitto costs with paho and nothing else, against edgefl's own
round in process and over the broker (issue 19, item 3; docs/scaling.md).

Item 3 asks for a round over the broker of at most twice the round in process (100
clients, 10 a round). Both runs keep the two CPUs busy, so the ratio is one of CPU. This
tool measures the part of the broker run's CPU no change inside edgefl can take away: the
same round's messages moved by paho-mqtt through the repo's Mosquitto config, with no frame
encoded or checked, no model trained, no state kept. Per round, as in steady state of
`edgefl simulate --transport mqtt` (counted by subscribing to '#', 2026-12-01): the
aggregator publishes one 32,513-byte copy of the model to each of 10 of the 100 clients, and
a 2,033-byte round announcement, a status, an event and a metrics record; each tasked
client answers with a 31,688-byte update; everything QoS 1, MQTT 3.1.1, persistent sessions,
the clients in two worker processes with 50 connections each, every connection served from
one thread per process by a select loop, as edgefl's NetworkLoop does.

Interleaved with it, in the same run: edgefl's in-process round and its round over the same
Mosquitto (`run_federation` and `run_over_broker`, Fashion-MNIST softmax, as
tools/bench_scale.py runs them), each read from /proc between the model of round 1 and that
of the last round.

    python tools/bench_broker_floor.py [--rounds 200] [--repeats 3] [--json]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import selectors
import statistics
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench import children, cpu_seconds, need_counts, print_result    # noqa: E402
from bench_scale import CpuMeter, Mosquitto, config_file    # noqa: E402

import paho.mqtt.client as paho    # noqa: E402

from edgefl import sim    # noqa: E402
from edgefl.runconfig import load_run_config    # noqa: E402
from edgefl.runs.prepare import prepare_run    # noqa: E402

MODEL_BYTES, UPDATE_BYTES = 32_513, 31_688      # a softmax model's frames on the wire
SMALL = {"round": 2_033, "status/aggregator": 177, "events": 193, "metrics/aggregator": 505}


def _client(name: str, port: int) -> paho.Client:
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=name, clean_session=False,
                    protocol=paho.MQTTv311)
    c.max_inflight_messages_set(16)
    c.connect("127.0.0.1", port, keepalive=30)
    return c


class SelectLoop:
    """Every connection of a process served by one thread: loop_read when readable,
    loop_write while it wants to, loop_misc every half second."""

    def __init__(self, clients: list):
        self.clients = clients
        self.sel = selectors.DefaultSelector()
        self.last_misc = time.monotonic()
        for c in clients:
            self.sel.register(c.socket(), selectors.EVENT_READ, c)

    def once(self, timeout: float = 0.05) -> None:
        for c in self.clients:
            if c.want_write():
                c.loop_write()
        for key, _ in self.sel.select(timeout):
            key.data.loop_read()
        for c in self.clients:
            if c.want_write():
                c.loop_write()
        if time.monotonic() - self.last_misc > 0.5:
            self.last_misc = time.monotonic()
            for c in self.clients:
                c.loop_misc()


def _worker(port: int, names: list, ready, stop) -> None:
    update = os.urandom(UPDATE_BYTES)
    clients = []
    for name in names:
        c = _client(name, port)

        def on_message(client, userdata, msg, name=name):
            client.publish(f"floor/update/{name}", update, qos=1)
        c.on_message = on_message
        c.subscribe(f"floor/model/{name}", qos=1)
        clients.append(c)
    loop = SelectLoop(clients)
    t_end = time.monotonic() + 5
    while time.monotonic() < t_end and not all(c.is_connected() for c in clients):
        loop.once(0.01)
    ready.set()
    while not stop.is_set():
        loop.once()
    for c in clients:
        c.disconnect()


def floor_run(port: int, clients: int, per_round: int, rounds: int, processes: int,
              broker_pid: int, seed: int) -> dict:
    """CPU ms a round of the floor's parts (aggregator, workers, broker, total)."""
    ctx = multiprocessing.get_context("fork")
    names = [f"floor-{seed}-{i}" for i in range(clients)]
    stop = ctx.Event()
    procs, readies = [], []
    share = -(-clients // processes)
    for k in range(processes):
        ready = ctx.Event()
        p = ctx.Process(target=_worker, args=(port, names[k * share:(k + 1) * share], ready,
                                              stop), daemon=True)
        p.start()
        procs.append(p)
        readies.append(ready)
    for ready in readies:
        if not ready.wait(30):
            raise SystemExit("floor: the worker processes did not connect within 30 s")
    got = []
    agg = _client(f"floor-aggregator-{seed}", port)
    agg.on_message = lambda client, userdata, msg: got.append(msg.topic)
    agg.subscribe("floor/update/+", qos=1)
    loop = SelectLoop([agg])
    model = os.urandom(MODEL_BYTES)
    small = {topic: os.urandom(n) for topic, n in SMALL.items()}
    rng = random.Random(seed)
    marks = {}
    for r in range(1, rounds + 1):
        if r in (2, rounds):
            marks[r] = {"aggregator": cpu_seconds(os.getpid()),
                        "workers": sum(cpu_seconds(p.pid) or 0.0 for p in procs),
                        "broker": cpu_seconds(broker_pid)}
        got.clear()
        for topic, payload in small.items():
            agg.publish(f"floor/{topic}", payload, qos=1)
        for i in sorted(rng.sample(range(clients), per_round)):
            agg.publish(f"floor/model/{names[i]}", model, qos=1)
        deadline = time.monotonic() + 30
        while len(got) < per_round:
            loop.once(0.05)
            if time.monotonic() > deadline:
                raise SystemExit(f"floor: round {r}: {len(got)} of {per_round} updates in 30 s")
    stop.set()
    for p in procs:
        p.join(10)
    agg.disconnect()
    n = rounds - 2
    out = {k: round((marks[rounds][k] - marks[2][k]) * 1e3 / n, 2) for k in marks[2]}
    out["total"] = round(sum(out.values()), 2)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    need_counts(parser, args, "clients", "per_round", "rounds", "repeats")
    if args.rounds < 3:
        parser.error(f"--rounds {args.rounds}: need at least 3 (rounds 2 to the last are read)")
    if args.per_round > args.clients:
        parser.error(f"--per-round {args.per_round}: more than the {args.clients} clients")
    scratch = tempfile.TemporaryDirectory(prefix="edgefl-bench-floor-")
    cfg = types.SimpleNamespace(dataset="fashion-mnist", limit_test=None, clients=args.clients,
                                rounds=args.rounds, per_round=args.per_round)
    run = prepare_run(load_run_config(config_file(scratch.name, cfg)), workers=2,
                      progress=False)
    broker = Mosquitto(scratch.name)
    runs = {"in process": [], "over Mosquitto": [], "paho alone": []}
    try:
        for repeat in range(args.repeats):
            meter = CpuMeter(args.rounds, broker.proc.pid)
            sim.run_federation(run.strategy, run.init_params, run.clients, run.setup,
                               args.per_round, workers=2,
                               test=(run.dataset.x_test, run.dataset.y_test), eval_every=1,
                               on_model=meter)
            runs["in process"].append(meter.per_round()["total"])
            meter = CpuMeter(args.rounds, broker.proc.pid)
            sim.run_over_broker(run, broker.url, workers=2, on_model=meter)
            runs["over Mosquitto"].append(meter.per_round()["total"])
            floor = floor_run(broker.port, args.clients, args.per_round, args.rounds, 2,
                              broker.proc.pid, repeat)
            runs["paho alone"].append(floor)
            leftover = [p for p in children(os.getpid()) if p != broker.proc.pid]
            if leftover:
                raise SystemExit(f"processes left after repeat {repeat + 1}: {leftover}")
    finally:
        broker.stop()
        scratch.cleanup()

    def span(values):
        return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
                "max": round(max(values), 2)}
    floors = runs["paho alone"]
    rows = [{"run": "edgefl, in process", **span(runs["in process"])},
            {"run": "edgefl, over Mosquitto", **span(runs["over Mosquitto"])}]
    for part in ("aggregator", "workers", "broker", "total"):
        rows.append({"run": f"paho alone: {part}", **span([f[part] for f in floors])})
    # Over the broker a round costs the in-process round's work, what paho and Mosquitto
    # cost to move its messages, and edgefl's own handling of them (frames, checks, roles,
    # threads; and whatever the round's work costs more beside them). At a ratio of 2 that
    # last part may be at most the in-process round less paho alone.
    trio = list(zip(runs["in process"], runs["over Mosquitto"], floors))
    rows.append({"run": "edgefl's own handling: over Mosquitto, less in process, less paho "
                        "alone", **span([b - a - f["total"] for a, b, f in trio])})
    rows.append({"run": "edgefl's own handling at a ratio of 2: in process less paho alone",
                 **span([a - f["total"] for a, b, f in trio])})
    meta = {"clients": args.clients, "per_round": args.per_round, "rounds": args.rounds,
            "repeats": args.repeats, "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "unit": "ms of CPU a round, rounds 2 to the last"}
    print_result(meta, rows, f"CPU a round: paho alone against edgefl ({args.clients} clients, "
                             f"{args.per_round} a round, {args.rounds} rounds, {args.repeats} "
                             f"interleaved repeats; {meta['at']})", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
