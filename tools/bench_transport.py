#!/usr/bin/env python3
"""Benchmarks of edgefl's transport: prints a Markdown table, or the rows as JSON (--json).

Run from a checkout with the extension built in place (or edgefl installed):
    python tools/bench_transport.py [--quick] [--json] [--only frame]

Every benchmark is a function in BENCHMARKS that yields one dict per table row; rows share
the keys `bench`, `impl` and `median_s` (median wall time over `repeats` timed calls, after
one untimed warm-up call; the operations compared in one row group take turns, so a drifting
machine biases none of them) and add their own. Everything runs on one thread: the
BLAS/OpenMP thread counts are pinned to 1 before NumPy is imported.

frame: edgefl.transport.wire on a model of P float32 parameters in four layers, for P in
  {1M, 10M} (--quick: 1M only) and compression none (f32 on the wire), f16 and int8:
    encode      wire.encode("update", ...) of one buffer: checks (finite; f16 range), codec,
                metadata, CRC32, one bytes object
    decode      wire.decode(...) with a full Expectation: header, CRC32, metadata, finite
                values; f32 returns a zero-copy view, f16/int8 decompress into a new array
    chunk-128k  wire.split(frame, 128 KiB) (AWS IoT's payload limit) and every chunk through a
                wire.Reassembler, which returns the decoded frame after the last one
    memcpy      np.copyto of the P floats into another buffer (the same 4P bytes read), as a
                reference for what the memory system allows
  gb_per_s = 4P / median_s / 1e9 for every row: float32 model bytes per second, whatever
  the bytes on the wire (wire_bytes), so compressions compare by what they deliver.
  vs_memcpy = gb_per_s / memcpy's gb_per_s at the same P. Targets (issue 4): f32 encode and
  decode >= 1 GB/s.

round: the aggregator and 10 clients (edgefl.roles, each with its own MQTT connection)
  training a 1M-parameter MLP (digits, 64-13333-10, one local step) through a broker,
  compression none, with frames chunked to 128 KiB (AWS IoT's limit) and unchunked (one
  message per frame), for each embedded broker: mosquitto (the production broker) and amqtt
  (the pure-Python fallback), and in two layouts (--topology):
    processes   as a fleet runs: every client a real `edgefl client` process (its shard
                from the run config's partition), the aggregator role in this process
    threads     as `edgefl simulate --transport mqtt` runs them: every role a thread of
                this one process, all under one interpreter lock
  Per round:
    round_s     wall time from the previous round's checkpoint to this round's (median over
                rounds 2..R-1: round 1 warms up -- and starts the client processes --, the
                last one also evaluates on the test set)
    train_s     the slowest client's local training that round (reported by the clients)
    overhead_s  round_s - train_s: selection, encoding, the broker, decoding, reassembly,
                aggregation and the fsync'ed checkpoint
    raw_s       raw paho-mqtt moving the same messages through the same broker in the same
                run, median of `repeats` rounds (half before the roles' run, half after),
                in the same layout:
                  processes: 10 raw client processes (tools/_raw_paho_client.py); this
                  process publishes the model's messages (QoS 1), each client publishes
                  its own as soon as it has them all, the round ends when the last has
                  arrived here -- a round's bytes in a round's pattern, nothing done to them
                  threads: one publisher sends the model's messages to 10 subscribers, then
                  10 publishers send theirs to one subscriber, all threads of this process
    vs_raw      overhead_s / raw_s (issue 4 target: <= 2 through Mosquitto)
    agg_cpu_s   CPU seconds of the aggregator's own thread per round (decoding, checking and
                aggregating the updates, the checkpoint): what bounds how many clients one
                aggregator serves per round (docs/scaling.md)
  Either way all processes share this machine's two cores; on a fleet every client
  decodes, trains and encodes on its own board.
fleet: a small model (softmax, 650 parameters) and 100 clients (50 with --quick), all
  selected every round, through Mosquitto: round time, overhead and the aggregator's CPU per
  round with a large fleet (docs/scaling.md).

memory: issue 4's memory target, "a client process training the MLP on Fashion-MNIST holds
  <= its data + 60 MB RSS". A real `edgefl client` process (its own interpreter, as a board
  runs it) holding one client's shard of Fashion-MNIST (one tenth of the training set: 6,000
  images, 18.8 MB of float32, in an .npz file its site file names, as a board stores its
  data), training the MLP 784-200-200-10 (FedAvg's 2NN, 199,210 parameters) for 3 rounds of
  one local epoch, through Mosquitto, with the aggregator in this process. Rows:
    data_mb      the client's training arrays (x_train + y_train bytes)
    peak_mb      the client process's peak resident set (VmHWM), polled until it exits
    over_data_mb peak_mb - data_mb (target: <= 60)
    import_mb    VmHWM of a process that only imports what the client imports (edgefl,
                 the C core, NumPy, OpenBLAS, paho-mqtt, PyYAML), without data: the floor
  Skipped with a note without Debian's dataset-fashion-mnist or mosquitto.

signing: what Ed25519 signatures cost (docs/security.md "Cost"). A 4 MB frame (1M
  parameters, f32): encode vs encode+sign and decode vs decode+verify (interleaved, with
  the added seconds and the ratio), and their parts: sha256 of 4 MB, one Ed25519 signature,
  one verification. Then whole rounds through Mosquitto, 10 `edgefl client` processes x 1M
  parameters, 128 KiB chunks, signatures off and on (every node keyed: the aggregator signs
  announcements and models and checks each update; each client checks the model and signs
  its update), in --pairs pairs of runs (default 6; --quick: 1), each pair off and on with
  the order alternating, --rounds measured rounds a run; once for each --local-epochs N
  (default 0 and 1): each client's local work N epochs of batch 32 on its shard (a real
  round, as bench_privacy.py's "1 epoch" rows), 0 one step of batch 8 (a stress case: the
  round is then nearly all transport and hashing). --dataset: the clients' data, digits
  (default: 180 samples a client, 64 inputs, the MLP 64-13333-10) or fashion-mnist (6,000
  a client, a tenth of the training set as a board of a ten-board fleet holds, the MLP
  784-1258-10, 1,000,120 parameters). Rows: per pair, the median round
  time of each run, their ratio, and the CPU seconds per round of all processes (the
  aggregator's process, the ten clients, Mosquitto: /proc/<pid>/stat, so the figure does
  not depend on how the two cores are shared) and of the aggregator alone; then the per-pair
  ratio's median and [min, max] (target <= 1.05), the CPU added per round, and the critical
  path estimate: the hashes and signatures signing puts in series in a round (every node on
  its own cores; senders hash before sending, receivers while the chunks arrive), from the
  timings above, against the unsigned round's median.

OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are removed before NumPy loads, as in
tools/bench_kernels.py (--keep-openblas-env keeps them).
"""
from __future__ import annotations

import os
import sys

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before numpy: one thread, comparable numbers
if "--keep-openblas-env" not in sys.argv:
    for _var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        os.environ.pop(_var, None)
os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import hashlib
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a source checkout
from _bench import cpu_seconds, time_medians, markdown, need_counts  # noqa: E402  (tools/ is the script directory)

from edgefl import kernels
from edgefl._malloc import keep_frames_in_heap
from edgefl.params import LayerTable
from edgefl.transport import wire

GB = 1e9
AWS_IOT_MAX_PAYLOAD = 128 * 1024


# ---------------------------------------------------------------------------------------
# frame: encode / decode / chunk+reassemble
# ---------------------------------------------------------------------------------------

def bench_table(p: int) -> LayerTable:
    """Four layers, P parameters: two dense layers and their biases."""
    return LayerTable.from_shapes([("fc1.weight", (p // 1000 - 12, 1000)), ("fc1.bias", (1000,)),
                                   ("fc2.weight", (10, 1000)), ("fc2.bias", (1000,))])


def bench_frame(args) -> Iterator[dict]:
    # The allocator settings the roles run with: without them each multi-megabyte frame is a
    # fresh mapping, and the 1M-parameter rows measured glibc's heap state (a 4x swing that
    # moved with import order alone) instead of the encoder.
    keep_frames_in_heap()
    sizes = [1_000_000] if args.quick else [1_000_000, 10_000_000]
    repeats = 5 if args.quick else 9
    for p in sizes:
        table = bench_table(p)
        assert table.size == p
        rng = np.random.default_rng(0)
        x = rng.standard_normal(p, dtype=np.float32)
        out = np.empty_like(x)
        model_bytes = 4 * p
        memcpy_t, = time_medians([lambda out=out, x=x: np.copyto(out, x)], repeats)
        memcpy_rate = model_bytes / memcpy_t / GB
        yield {"bench": "frame", "P": p, "compression": "-", "impl": "memcpy",
               "gb_per_s": round(memcpy_rate, 2), "median_s": round(memcpy_t, 5),
               "repeats": repeats, "wire_bytes": model_bytes, "vs_memcpy": 1.0}
        for compression in ("none", "f16", "int8"):
            yield from _frame_rows(table, x, compression, repeats, memcpy_rate)


def _frame_rows(table: LayerTable, x: np.ndarray, compression: str, repeats: int,
                memcpy_rate: float) -> Iterator[dict]:
    scalars = {"num_samples": 600, "train_loss": 0.4321}
    expect = wire.Expectation(table, kinds="update", rounds=7, topic_sender="pi-07")

    def encode():
        return wire.encode("update", 7, "pi-07", {"params": x}, scalars, table, compression)

    data = encode()
    frame = wire.decode(data, expect)
    if compression == "none":  # the zero-copy claim, checked where it is measured
        assert np.shares_memory(frame.buffers["params"], np.frombuffer(data, np.uint8))

    def decode():
        return wire.decode(data, expect)

    def chunk_128k():
        reassembler = wire.Reassembler(timeout_s=600)
        got = None
        for chunk in wire.split(data, AWS_IOT_MAX_PAYLOAD):
            got = reassembler.add(chunk, expect)
        assert got is not None
        return got

    ops = [("encode", encode), ("decode", decode), ("chunk-128k", chunk_128k)]
    medians = time_medians([fn for _, fn in ops], repeats)
    n_chunks = len(wire.split(data, AWS_IOT_MAX_PAYLOAD))
    for (op, _), t in zip(ops, medians):
        rate = 4 * x.size / t / GB
        row = {"bench": "frame", "P": x.size, "compression": compression, "impl": op,
               "backend": kernels.backend,
               "gb_per_s": round(rate, 2), "median_s": round(t, 5), "repeats": repeats,
               "wire_bytes": len(data), "vs_memcpy": round(rate / memcpy_rate, 2)}
        if op == "chunk-128k":
            row["chunks"] = n_chunks
        yield row


# ---------------------------------------------------------------------------------------
# round: per-round overhead of the roles through a broker, next to raw paho
# ---------------------------------------------------------------------------------------

ROUND_CLIENTS = 10
ROUND_HIDDEN = 13333          # 64*13333 + 13333 + 13333*10 + 10 = 999,985 parameters
# bench_signing --dataset: the hidden width that makes the one-hidden-layer MLP ~1M
# parameters on that data set's inputs, and the parameter count it gives
SIGNING_MODELS = {"digits": (ROUND_HIDDEN, 999_985),              # 64 inputs
                  "fashion-mnist": (1258, 1_000_120)}            # 784*1258+1258+12580+10


def _run_mapping(clients: int, rounds: int, model: dict, train: dict,
                 dataset: str = "digits") -> dict:
    return {"dataset": {"name": dataset}, "partition": {"name": "iid", "clients": clients},
            "model": model, "strategy": {"name": "fedavg"}, "train": train, "rounds": rounds,
            "clients_per_round": clients, "seed": 0, "eval_every": rounds}


def _run_config(clients: int, rounds: int, model: dict, train: dict):
    from edgefl.runconfig import run_config_from_mapping

    return run_config_from_mapping(_run_mapping(clients, rounds, model, train))


def _with_cycles(history: list, commits: list) -> list[dict]:
    """The round records with `cycle_s` (wall time from the previous round's commit to this
    one's) and `agg_cpu_s` (the aggregator thread's CPU in between), from `commits`, the
    (perf_counter, thread_time) pairs taken at each commit."""
    history = [dict(h) for h in history]
    for i in range(1, len(history)):
        history[i]["cycle_s"] = commits[i][0] - commits[i - 1][0]
        history[i]["agg_cpu_s"] = commits[i][1] - commits[i - 1][1]
    history[0]["cycle_s"] = history[0]["wall_s"]
    history[0]["agg_cpu_s"] = float("nan")
    return history


def _roles_rounds(config, url: str, max_payload: int) -> list[dict]:
    """The per-round records of a run of the roles through the broker at `url`, each with
    `cycle_s`: the time from the previous round's commit (checkpoint written) to this one's,
    so everything the aggregator does between rounds counts."""
    from edgefl.runs.prepare import prepare_run
    from edgefl.sim import run_over_broker

    run = prepare_run(config, progress=False)
    commits = []        # (wall clock, the aggregator thread's CPU time) at each commit
    result, _ = run_over_broker(
        run, url, max_payload=max_payload, round_timeout_s=600, workers=os.cpu_count() or 1,
        on_round=lambda record: commits.append((time.perf_counter(), time.thread_time())))
    return _with_cycles(result.history, commits)


def _raw_paho_round(url: str, clients: int, payloads: list[bytes], timeout: float = 120.0):
    """Seconds raw paho-mqtt needs to move one round's messages through the broker: the
    model's chunks from one publisher to `clients` subscribers, then each client's chunks to
    one subscriber (QoS 1 both ways, TCP_NODELAY as edgefl sets it)."""
    import socket
    import threading

    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    from edgefl.transport.mqtt import parse_broker_url

    address = parse_broker_url(url)
    tag = os.urandom(4).hex()
    made = []

    def nodelay(client, userdata, sock):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connect(name, topic=None, expect=0):
        done = threading.Event()
        state = {"n": 0}
        subscribed = threading.Event()
        client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"raw-{tag}-{name}",
                             clean_session=True)
        client.max_inflight_messages_set(16)
        client.on_socket_open = nodelay

        def on_message(c, u, msg):
            state["n"] += 1
            if state["n"] >= expect:
                done.set()

        client.on_message = on_message
        client.on_subscribe = lambda *a: subscribed.set()
        if topic is not None:   # on every connect: amqtt may drop one under a burst
            client.on_connect = lambda c, u, flags, rc, props: c.subscribe(topic, qos=1)
        client.reconnect_delay_set(0.1, 1.0)
        client.connect(address.host, address.port, keepalive=60)
        client.loop_start()
        if topic is not None and not subscribed.wait(30):
            raise RuntimeError(f"raw paho: no SUBACK from {address}")
        made.append(client)
        return client, done, state

    try:
        down = f"raw/{tag}/model"
        up = f"raw/{tag}/update/+"
        n = len(payloads)
        subscribers = [connect(f"c{i}", down, n) for i in range(clients)]
        aggregator, agg_done, _ = connect("agg", up, n * clients)
        publishers = [connect(f"p{i}")[0] for i in range(clients)]
        t0 = time.perf_counter()
        for p in payloads:
            aggregator.publish(down, p, qos=1)
        for _, done, _ in subscribers:
            if not done.wait(timeout):
                raise RuntimeError("raw paho: the model did not reach every subscriber")
        for i, pub in enumerate(publishers):
            for p in payloads:
                pub.publish(f"raw/{tag}/update/c{i}", p, qos=1)
        if not agg_done.wait(timeout):
            raise RuntimeError("raw paho: not every update reached the aggregator")
        return time.perf_counter() - t0
    finally:
        for client in made:
            client.disconnect()
            client.loop_stop()


def _raw_paho_processes(url: str, clients: int, payloads: list[bytes], repeats: int,
                        timeout: float = 120.0) -> list[float]:
    """Seconds per round for raw paho-mqtt with every client its own process
    (tools/_raw_paho_client.py): this process publishes the model's messages (QoS 1), each
    client publishes its own once it has them all, and the round ends when the last update
    message has arrived here: the bytes a fleet's round moves, in the same pattern, with
    nothing done to them. One value per repeat, in one set of connected processes."""
    import socket
    import subprocess
    import tempfile
    import threading

    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    from edgefl.transport.mqtt import parse_broker_url

    address = parse_broker_url(url)
    tag = os.urandom(4).hex()
    n = len(payloads)
    lock, got, done = threading.Lock(), [0], threading.Event()
    agg = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"raw-{tag}-agg", clean_session=True)
    agg.max_inflight_messages_set(16)
    agg.on_socket_open = lambda c, u, sock: sock.setsockopt(socket.IPPROTO_TCP,
                                                            socket.TCP_NODELAY, 1)

    def on_message(c, u, msg):
        with lock:
            got[0] += 1
            if got[0] == n * clients:
                done.set()

    subscribed = threading.Event()
    agg.on_message = on_message
    agg.on_subscribe = lambda *a: subscribed.set()
    agg.on_connect = lambda c, u, flags, rc, props: c.subscribe(f"raw/{tag}/update/+", qos=1)
    agg.reconnect_delay_set(0.1, 1.0)
    procs = []
    with tempfile.NamedTemporaryFile(prefix="edgefl-raw-", suffix=".bin") as blob:
        blob.write(json.dumps([len(p) for p in payloads]).encode() + b"\n" + b"".join(payloads))
        blob.flush()
        try:
            agg.connect(address.host, address.port, keepalive=60)
            agg.loop_start()
            if not subscribed.wait(30):
                raise RuntimeError(f"raw paho: no SUBACK from {address}")
            script = str(Path(__file__).resolve().parent / "_raw_paho_client.py")
            for i in range(clients):
                procs.append(subprocess.Popen(
                    [sys.executable, script, address.host, str(address.port), tag, str(i),
                     blob.name], stdin=subprocess.PIPE, stdout=subprocess.PIPE))
            for proc in procs:
                if proc.stdout.readline().strip() != b"ready":
                    raise RuntimeError("raw paho: a client process did not get ready")
            times = []
            for _ in range(repeats):
                got[0] = 0
                done.clear()
                t0 = time.perf_counter()
                for p in payloads:
                    agg.publish(f"raw/{tag}/model", p, qos=1)
                if not done.wait(timeout):
                    raise RuntimeError("raw paho: not every update reached the aggregator")
                times.append(time.perf_counter() - t0)
            return times
        finally:
            for proc in procs:
                try:
                    proc.stdin.close()
                    proc.wait(10)
                except (OSError, subprocess.TimeoutExpired):
                    proc.kill()
            agg.disconnect()
            agg.loop_stop()


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far, 0 once it is gone."""
    return cpu_seconds(pid) or 0.0


def _roles_rounds_processes(config_map: dict, url: str, max_payload: int,
                            signed: bool = False, broker_pid: int | None = None) -> list[dict]:
    """_roles_rounds with a fleet's process layout: every client a real `edgefl client`
    process (its shard from the run config's partition, --partition/--shard), the
    aggregator role in this process. Round 1 includes the clients' start-up. signed: every
    node has a key (site files' keys.*): the aggregator signs its announcements and model
    frames and checks every update's signature, each client checks the aggregator's and
    signs its update. Each record also has `cpu`: the CPU seconds, at its commit, of this
    process (the aggregator and its network thread), of all the client processes, and of
    the broker process `broker_pid` (when given)."""
    import subprocess
    import tempfile

    import yaml

    from edgefl.roles import Aggregator, AggregatorSettings, RunPlan, default_client_ids
    from edgefl.roles.trust import Trust
    from edgefl.runconfig import run_config_from_mapping
    from edgefl.transport.signing import write_key_pair
    from edgefl.runs.prepare import prepare_run
    from edgefl.transport.mqtt import MqttTransport

    config = run_config_from_mapping(config_map)
    run = prepare_run(config, progress=False)
    ids = default_client_ids(len(run.setup.clients))
    federation = f"bench{os.urandom(3).hex()}"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)
               + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    commits = []
    with tempfile.TemporaryDirectory(prefix="edgefl-fleet-") as tmp:
        run_file = os.path.join(tmp, "run.yaml")
        with open(run_file, "w") as f:
            yaml.safe_dump(config_map, f)
        procs = []
        trust = None
        if signed:
            keys = os.path.join(tmp, "keys")
            os.makedirs(os.path.join(keys, "fleet"))
            agg_key, agg_pub = write_key_pair(os.path.join(keys, "aggregator"))
            for node in ids:
                write_key_pair(os.path.join(keys, "fleet", node))
            trust = Trust.load(fed=federation, node="aggregator", signing_key=agg_key,
                               fleet=os.path.join(keys, "fleet"))
        try:
            for i, node in enumerate(ids):
                site = os.path.join(tmp, f"{node}.yaml")
                doc = {"node": {"id": node, "federation": federation},
                       "broker": {"url": url}, "state_dir": os.path.join(tmp, node),
                       "log": {"level": "warning"}, "profile": "generic-x86",
                       "transport": {"chunk_size": max_payload, "compression": "none"}}
                if signed:
                    doc["keys"] = {"signing_key": os.path.join(keys, "fleet", node),
                                   "aggregator": [agg_pub]}
                with open(site, "w") as f:
                    yaml.safe_dump(doc, f)
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "edgefl.cli", "client", "--config", site,
                     "--partition", run_file, "--shard", str(i), "--exit-when-finished"],
                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            plan = RunPlan(run.strategy, run.init_params, run.setup, run.model,
                           config.clients_per_round, ids,
                           test=(run.dataset.x_test, run.dataset.y_test),
                           eval_every=config.eval_every, description=config.to_dict())
            settings = AggregatorSettings(federation=federation, round_timeout_s=600,
                                          max_payload=max_payload, compression="none",
                                          trust=trust)
            cpu = []

            def on_round(record, history):
                commits.append((time.perf_counter(), time.thread_time()))
                cpu.append({"aggregator": time.process_time(),
                            "clients": sum(_proc_cpu_s(p.pid) for p in procs),
                            "broker": _proc_cpu_s(broker_pid) if broker_pid else 0.0})

            aggregator = Aggregator(
                plan, MqttTransport(url, f"edgefl-{federation}-aggregator", clean_session=True),
                os.path.join(tmp, "aggregator"), settings, on_round=on_round)
            result = aggregator.run()
            for proc in procs:
                if proc.wait(60) != 0:
                    raise RuntimeError(f"an edgefl client exited {proc.returncode}: "
                                       f"{proc.stderr.read().decode()[-500:]}")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    history = _with_cycles(result.history, commits)
    for h, c in zip(history, cpu):
        h["cpu"] = c
    return history


def bench_round(args) -> Iterator[dict]:
    from edgefl.runs.prepare import prepare_run
    from edgefl.transport.broker import (EmbeddedBroker, find_mosquitto, have_python_broker,
                                         packet_bytes_for)

    rounds = 4 if args.quick else 7
    repeats = 3 if args.quick else 5
    model, train = {"name": "mlp", "hidden": [ROUND_HIDDEN]}, {"lr": 0.01, "batch_size": 8,
                                                                "steps": 1}
    config = _run_config(ROUND_CLIENTS, rounds, model, train)
    # the process fleet: round 1 includes ten interpreters starting, so two more rounds
    fleet_map = _run_mapping(ROUND_CLIENTS, rounds + 2, model, train)
    table = prepare_run(config, progress=False).model.table
    x = np.random.default_rng(0).standard_normal(table.size).astype(np.float32)
    frame = wire.encode("update", 1, "client-0", {"params": x},
                        {"run": "bench", "num_samples": 180, "train_loss": 1.0, "steps": 1,
                         "train_s": 0.0, "strategy": {}}, table)
    whole = 1 << (len(frame) - 1).bit_length()          # one message per frame
    chunks = [AWS_IOT_MAX_PAYLOAD, whole]
    brokers = [("mosquitto", find_mosquitto() is not None), ("amqtt", have_python_broker())]
    topologies = args.topology or ["processes", "threads"]
    for name, available in brokers:
        for chunk in chunks:
            for topology in topologies:
                payloads = wire.split(frame, chunk)
                row = {"bench": "round", "impl": f"roles/{name}", "topology": topology,
                       "clients": ROUND_CLIENTS, "P": table.size,
                       "chunk": chunk if chunk < whole else "whole frame",
                       "messages": len(payloads) * (1 + ROUND_CLIENTS)}
                if not available:
                    row["note"] = f"{name} not installed: skipped"
                    yield row
                    continue
                kind = "mosquitto" if name == "mosquitto" else "python"
                with EmbeddedBroker(kind=kind,
                                    max_packet_bytes=packet_bytes_for(chunk)) as broker:
                    # raw rounds before and after the roles' run, so that a machine
                    # whose speed drifts during the row biases neither side of vs_raw
                    before = (repeats + 1) // 2
                    if topology == "processes":
                        def raw_rounds(n):
                            return _raw_paho_processes(broker.url, ROUND_CLIENTS, payloads, n)

                        def roles_rounds():
                            return _roles_rounds_processes(fleet_map, broker.url, chunk)
                    else:
                        def raw_rounds(n):
                            return [_raw_paho_round(broker.url, ROUND_CLIENTS, payloads)
                                    for _ in range(n)]

                        def roles_rounds():
                            return _roles_rounds(config, broker.url, chunk)
                    raw = raw_rounds(before)
                    history = roles_rounds()
                    raw += raw_rounds(repeats - before)
                middle = history[1:-1] or history
                round_s = statistics.median(h["cycle_s"] for h in middle)
                train_s = statistics.median(h["train_wall_s"] for h in middle)
                overhead = statistics.median(h["cycle_s"] - h["train_wall_s"] for h in middle)
                raw_s = statistics.median(raw)
                row.update({"round_s": round(round_s, 4), "train_s": round(train_s, 4),
                            "overhead_s": round(overhead, 4), "raw_s": round(raw_s, 4),
                            "vs_raw": round(overhead / raw_s, 2),
                            "agg_cpu_s": round(statistics.median(h["agg_cpu_s"]
                                                                 for h in middle), 4),
                            "rounds": len(middle), "repeats": repeats})
                yield row


def bench_fleet(args) -> Iterator[dict]:
    """100 clients (50 with --quick) with a 650-parameter model through Mosquitto."""
    from edgefl.transport.broker import EmbeddedBroker, find_mosquitto

    clients = 50 if args.quick else 100
    rounds = 4 if args.quick else 6
    row = {"bench": "fleet", "impl": "roles/mosquitto", "clients": clients, "P": 650}
    if find_mosquitto() is None:
        row["note"] = "mosquitto not installed: skipped"
        yield row
        return
    config = _run_config(clients, rounds, {"name": "softmax"},
                         {"lr": 0.1, "batch_size": 32, "epochs": 1})
    with EmbeddedBroker(kind="mosquitto") as broker:
        t0 = time.perf_counter()
        history = _roles_rounds(config, broker.url, AWS_IOT_MAX_PAYLOAD)
        total = time.perf_counter() - t0
    middle = history[1:-1] or history
    row.update({"round_s": round(statistics.median(h["cycle_s"] for h in middle), 4),
                "train_s": round(statistics.median(h["train_wall_s"] for h in middle), 4),
                "overhead_s": round(statistics.median(h["cycle_s"] - h["train_wall_s"]
                                                      for h in middle), 4),
                "agg_cpu_s": round(statistics.median(h["agg_cpu_s"] for h in middle), 4),
                "updates": min(h["updates"] for h in history), "rounds": len(middle),
                "run_s": round(total, 2)})
    yield row


def _vm_hwm_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _peak_of(cmd: list, env: dict, timeout: float) -> tuple[float, int, str]:
    """(peak VmHWM MiB, exit code, stderr tail) of a child process, polled until it exits."""
    import subprocess

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak, end = 0.0, time.monotonic() + timeout
    import threading
    err = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    while proc.poll() is None and time.monotonic() < end:
        peak = max(peak, _vm_hwm_mb(proc.pid) or 0.0)
        time.sleep(0.02)
    if proc.poll() is None:
        proc.kill()
    code = proc.wait()
    reader.join(5)
    return peak, code, (err[0] if err else b"").decode(errors="replace")[-2000:]


def bench_memory(args) -> Iterator[dict]:
    """A real client process's peak RSS over its data (issue 4's memory target)."""
    import tempfile
    import threading

    import yaml

    from edgefl.data import load_dataset
    from edgefl.roles import Aggregator, AggregatorSettings, RunPlan
    from edgefl.runconfig import run_config_from_mapping
    from edgefl.runs.prepare import prepare_run
    from edgefl.transport.broker import EmbeddedBroker, find_mosquitto
    from edgefl.transport.mqtt import MqttTransport

    row = {"bench": "memory", "impl": "edgefl client", "model": "mlp 784-200-200-10",
           "target_over_data_mb": 60}
    if find_mosquitto() is None or not os.path.isdir("/usr/share/datasets/fashion-mnist"):
        row["note"] = "needs mosquitto and Debian's dataset-fashion-mnist: skipped"
        yield row
        return
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)
               + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    with tempfile.TemporaryDirectory(prefix="edgefl-mem-") as tmp:
        ds = load_dataset("fashion-mnist", limit_train=6000, limit_test=1000)
        shard = os.path.join(tmp, "shard.npz")
        np.savez(shard, x_train=ds.x_train, y_train=ds.y_train, x_test=ds.x_test,
                 y_test=ds.y_test)
        data_mb = (ds.x_train.nbytes + ds.y_train.nbytes) / 2 ** 20
        del ds
        config = run_config_from_mapping({
            "dataset": {"name": "npz", "path": shard, "normalize": "none"},
            "partition": {"name": "iid", "clients": 1},
            "model": {"name": "mlp", "hidden": [200, 200]}, "strategy": {"name": "fedavg"},
            "train": {"lr": 0.05, "batch_size": 32, "epochs": 1}, "rounds": 3,
            "clients_per_round": 1, "seed": 0})
        run = prepare_run(config, progress=False)
        plan = RunPlan(run.strategy, run.init_params, run.setup, run.model, 1, ("client-0",),
                       test=(run.dataset.x_test, run.dataset.y_test), description=config.to_dict())
        federation = f"mem{os.getpid()}"
        with EmbeddedBroker(kind="mosquitto") as broker:
            site = os.path.join(tmp, "client.yaml")
            with open(site, "w") as f:
                yaml.safe_dump({"node": {"id": "client-0", "federation": federation},
                                "broker": {"url": broker.url},
                                "state_dir": os.path.join(tmp, "client"),
                                "log": {"level": "warning"}, "profile": "generic-x86",
                                "data": {"name": "npz", "path": shard, "normalize": "none"}}, f)
            aggregator = Aggregator(plan, MqttTransport(broker.url, "aggregator"),
                                    os.path.join(tmp, "agg"),
                                    AggregatorSettings(federation=federation,
                                                       round_timeout_s=300))
            done = threading.Thread(target=aggregator.run, daemon=True)
            done.start()
            peak, code, err = _peak_of(
                [sys.executable, "-m", "edgefl.cli", "client", "--config", site,
                 "--exit-when-finished"], env, timeout=600)
            done.join(60)
        if code != 0:
            row["note"] = f"client exited {code}: {err.strip().splitlines()[-1:]}"
            yield row
            return
        floor, _, _ = _peak_of([sys.executable, "-c",
                                "import edgefl, edgefl.kernels, edgefl.roles.client, "
                                "edgefl.transport.mqtt, yaml"], env, timeout=120)
    row.update({"data_mb": round(data_mb, 1), "peak_mb": round(peak, 1),
                "over_data_mb": round(peak - data_mb, 1), "import_mb": round(floor, 1)})
    yield row


# ---------------------------------------------------------------------------------------
# registry: each entry yields row dicts; keep one function per benchmark
# ---------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------
# signing: what signatures cost (docs/security.md "Cost")
# ---------------------------------------------------------------------------------------

def bench_signing(args) -> Iterator[dict]:
    """A 4 MB frame (1M float32 parameters) signed and verified, next to encoding and
    decoding it unsigned; then whole rounds with signatures on and off through Mosquitto,
    10 `edgefl client` processes x 1M parameters, runs interleaved (off, on, off, on...)."""
    from edgefl.transport import signing
    from edgefl.transport.broker import find_mosquitto

    keep_frames_in_heap()
    repeats = 5 if args.quick else 11
    p = 1_000_000
    table = bench_table(p)
    x = np.random.default_rng(0).standard_normal(p, dtype=np.float32)
    key = signing.generate_key()
    signer = signing.Signer(key, "pi-07", "bench")
    verifier = signing.Verifier("bench", {"pi-07": [key.public_key()]})
    scalars = {"run": "bench", "num_samples": 600, "train_loss": 0.4321}
    expect = wire.Expectation(table, kinds="update", rounds=7, topic_sender="pi-07")
    signed = wire.encode("update", 7, "pi-07", {"params": x}, scalars, table,
                         sign=signer.frame_signer("bench"))
    plain = wire.encode("update", 7, "pi-07", {"params": x}, scalars, table)

    ops = [("encode", lambda: wire.encode("update", 7, "pi-07", {"params": x}, scalars,
                                          table)),
           ("encode+sign", lambda: wire.encode("update", 7, "pi-07", {"params": x}, scalars,
                                               table, sign=signer.frame_signer("bench"))),
           ("decode", lambda: wire.decode(plain, expect)),
           ("decode+verify", lambda: verifier.verify_frame(
               wire.decode(signed, expect), kind="update", where="bench", run="bench",
               by="pi-07")),
           ("sha256 4 MB", lambda: hashlib.sha256(memoryview(x).cast("B")).digest()),
           ("ed25519 sign", lambda: key.sign(b"x" * 300)),
           ("ed25519 verify", lambda k=key.public_key(), s=key.sign(b"x" * 300):
               k.verify(s, b"x" * 300))]
    medians = time_medians([fn for _, fn in ops], repeats)
    base = dict(zip([o for o, _ in ops], medians))
    for (op, _), t in zip(ops, medians):
        row = {"bench": "signing", "impl": op, "P": p, "median_s": round(t, 6),
               "repeats": repeats}
        if op in ("encode+sign", "decode+verify"):
            plain_t = base[op.split("+")[0]]
            row["added_s"] = round(t - plain_t, 6)
            row["vs_unsigned"] = round(t / plain_t, 2)
        yield row

    row = {"bench": "signing", "impl": "round roles/mosquitto", "topology": "processes",
           "clients": ROUND_CLIENTS, "P": None, "chunk": AWS_IOT_MAX_PAYLOAD}
    if find_mosquitto() is None:
        row["note"] = "mosquitto not installed: skipped"
        yield row
        return
    rounds = 4 if args.quick else args.rounds
    pairs = 1 if args.quick else args.pairs
    # the hashes (sha256 of 4 MB, fastest of the timed calls) once, for every critical-path row
    fastest = min(_sha256_times(x, repeats))
    for epochs in sorted(set(args.local_epochs)):
        yield from _signing_rounds(args, row, base, x, fastest, repeats, rounds, pairs, epochs)


def _signing_rounds(args, row: dict, base: dict, x, fastest: float, repeats: int, rounds: int,
                    pairs: int, epochs: int) -> Iterator[dict]:
    """bench_signing's whole rounds, each client's local work `epochs` epochs of batch 32
    on its shard (0: one step of batch 8, the round then nearly all transport), on
    args.dataset split IID over the ten clients."""
    from edgefl.transport.broker import EmbeddedBroker, packet_bytes_for

    hidden, n_params = SIGNING_MODELS[args.dataset]
    model = {"name": "mlp", "hidden": [hidden]}
    if epochs:
        train = {"lr": 0.05, "batch_size": 32, "epochs": epochs}
        local = f"{epochs} epoch" + ("s" if epochs > 1 else "")
    else:
        train = {"lr": 0.01, "batch_size": 8, "steps": 1}
        local = "1 step"
    row = dict(row, local=local, dataset=args.dataset)
    fleet_map = _run_mapping(ROUND_CLIENTS, rounds + 2, model, train, dataset=args.dataset)
    results = []            # per pair: {False: run, True: run}
    with EmbeddedBroker(kind="mosquitto",
                        max_packet_bytes=packet_bytes_for(AWS_IOT_MAX_PAYLOAD)) as broker:
        broker_pid = broker.pid
        for i in range(pairs):
            pair = {}
            # alternate which goes first, so a drifting machine favours neither
            for signed_run in ((False, True) if i % 2 == 0 else (True, False)):
                history = _roles_rounds_processes(fleet_map, broker.url, AWS_IOT_MAX_PAYLOAD,
                                                  signed=signed_run, broker_pid=broker_pid)
                pair[signed_run] = _signing_run(history)
            results.append(pair)
            off, on = pair[False], pair[True]
            yield dict(row, P=n_params, impl=f"pair {i + 1}", order="off, on" if i % 2 == 0
                       else "on, off", off_round_s=round(off["round_s"], 4),
                       on_round_s=round(on["round_s"], 4),
                       ratio=round(on["round_s"] / off["round_s"], 3),
                       off_cpu_s=round(off["cpu_s"], 4), on_cpu_s=round(on["cpu_s"], 4),
                       cpu_added_s=round(on["cpu_s"] - off["cpu_s"], 4),
                       off_agg_cpu_s=round(off["agg_cpu_s"], 4),
                       on_agg_cpu_s=round(on["agg_cpu_s"], 4), rounds=off["rounds"])

    def spread(values, digits=3):
        return (round(statistics.median(values), digits),
                f"[{min(values):.{digits}f}, {max(values):.{digits}f}]")

    ratios = [p[True]["round_s"] / p[False]["round_s"] for p in results]
    median, span = spread(ratios)
    yield dict(row, P=n_params, impl="round: signatures on / off, per pair", ratio=median,
               range=span, pairs=pairs, target="<= 1.05")
    added = [p[True]["cpu_s"] - p[False]["cpu_s"] for p in results]
    median, span = spread(added, 4)
    cpu_ratio = [p[True]["cpu_s"] / p[False]["cpu_s"] for p in results]
    yield dict(row, P=n_params, impl="CPU of all processes per round: added by signatures",
               added_s=median, range=span, ratio=spread(cpu_ratio)[0],
               ratio_range=spread(cpu_ratio)[1],
               off_cpu_s=round(statistics.median(p[False]["cpu_s"] for p in results), 4))
    agg_added = [p[True]["agg_cpu_s"] - p[False]["agg_cpu_s"] for p in results]
    median, span = spread(agg_added, 4)
    yield dict(row, P=n_params, impl="aggregator CPU per round: added by signatures",
               added_s=median, range=span)
    # The critical path, every node on its own cores: what signing puts in series between
    # one round's commit and the next. Senders hash before the first chunk leaves (the
    # signature is in it): a board its update (one hash, however many cores); the
    # aggregator nothing: its model frame's payload hash is the sha256 the journal took at
    # the commit, signed or not (wire.content_digest; from round 2 of a run). Receivers
    # hash while the chunks arrive: only the last chunk's share is left (the board's model,
    # the aggregator's last update). Plus two Ed25519 signatures and two verifications.
    # With the sha256 time of a quiet core (the fastest of the timed calls) and of this run
    # (the median), against the unsigned round measured here.
    tail = AWS_IOT_MAX_PAYLOAD / x.nbytes
    ed = 2 * base["ed25519 sign"] + 2 * base["ed25519 verify"]
    off_round = statistics.median(p[False]["round_s"] for p in results)
    for label, h in (("quiet", fastest), ("this run", base["sha256 4 MB"])):
        critical = (1 + 2 * tail) * h + ed
        yield dict(row, P=n_params, impl=f"critical path estimate, sha256 {label}",
                   sha256_s=round(h, 5), added_s=round(critical, 4),
                   off_round_s=round(off_round, 4),
                   ratio=round((off_round + critical) / off_round, 3), target="<= 1.05")


def _sha256_times(x: np.ndarray, repeats: int) -> list[float]:
    data = memoryview(x).cast("B")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        hashlib.sha256(data).digest()
        times.append(time.perf_counter() - t0)
    return times


def _signing_run(history: list) -> dict:
    """One run's figures, from its middle rounds (round 1-2: the processes start; the last:
    they exit): median round time, and the CPU seconds per round of every process
    (aggregator + clients + broker) and of the aggregator's process alone, from the first
    to the last of those rounds' commits."""
    middle = list(range(2, len(history) - 1)) or list(range(1, len(history)))
    first, last = middle[0] - 1, middle[-1]
    n = last - first

    def cpu(keys):
        return sum(history[last]["cpu"][k] - history[first]["cpu"][k] for k in keys) / n
    return {"round_s": statistics.median(history[i]["cycle_s"] for i in middle),
            "cpu_s": cpu(("aggregator", "clients", "broker")),
            "agg_cpu_s": cpu(("aggregator",)), "rounds": n}


BENCHMARKS: list[Callable[[argparse.Namespace], Iterator[dict]]] = [
    bench_frame,
    bench_round,
    bench_fleet,
    bench_memory,
    bench_signing,
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, fewer repeats")
    ap.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    ap.add_argument("--only", action="append", metavar="NAME",
                    help="run only this benchmark (repeatable): "
                         + ", ".join(b.__name__.removeprefix("bench_") for b in BENCHMARKS))
    ap.add_argument("--topology", action="append", choices=["processes", "threads"],
                    help="round: only this layout of the roles (repeatable; default both)")
    ap.add_argument("--pairs", type=int, default=6,
                    help="signing: interleaved off/on pairs of whole runs (default 6)")
    ap.add_argument("--rounds", type=int, default=6,
                    help="signing: measured rounds per run (default 6; 2 more start up)")
    ap.add_argument("--local-epochs", type=int, action="append", metavar="N",
                    help="signing: each client's local work, N epochs of batch 32 on its "
                         "shard, 0 one step of batch 8 (repeatable; default 0 and 1)")
    ap.add_argument("--dataset", choices=sorted(SIGNING_MODELS), default="digits",
                    help="signing: the clients' data for the whole rounds (default digits: "
                         "180 samples a client, the round mostly transport; fashion-mnist: "
                         "6,000 a client, as a board holding a tenth of the set)")
    ap.add_argument("--keep-openblas-env", action="store_true",
                    help="keep OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE (read before NumPy loads)")
    args = ap.parse_args(argv)
    need_counts(ap, args, "pairs")
    if args.local_epochs is None:
        args.local_epochs = [0, 1]
    if any(n < 0 for n in args.local_epochs):
        ap.error(f"--local-epochs {args.local_epochs}: need 0 (one step) or more epochs")
    chosen = [b for b in BENCHMARKS
              if not args.only or b.__name__.removeprefix("bench_") in args.only]
    if not chosen:
        ap.error(f"--only {args.only}: no such benchmark")
    print(f"edgefl backend: {kernels.backend}", file=sys.stderr)
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
