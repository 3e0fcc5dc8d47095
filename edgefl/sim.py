"""In-process simulation: the aggregator and N virtual clients in one process
(DESIGN.md "Who uses it" 1; issue #3 item 4).

`run_federation` is the round loop over in-memory clients: select -> configure -> train the
tasked clients in a thread pool (the C core releases the GIL) -> aggregate in sorted client
order -> evaluate. `run_over_broker` runs the same rounds through an MQTT broker with the
real roles (edgefl.roles: the aggregator and one client per shard, each with its own
connection, as threads of this process). `simulate` wraps either for a RunConfig
(`transport="inproc"` or `"mqtt"`): prepares the run as `edgefl aggregator` does
(roles.runner.prepare_run: data set, partition, model) and writes to an output directory
(metrics.jsonl as the rounds end, the rest by roles.outputs)

    metrics.jsonl  one JSON object per round: round, test_accuracy, test_loss (null on
                   rounds not evaluated), train_loss (mean over the uploaders' local steps),
                   uplink_bytes, downlink_bytes (float32 bytes of the buffers actually sent,
                   summed over recipients), wall_s (this round), train_wall_s (the parallel
                   phase: the clients' training and, with more than one thread, the previous
                   round's evaluation), elapsed_s, selected (sorted ids), trained (clients that
                   trained; FedUmf trains unselected ones too), plus the strategy's metrics
    summary.json   final/best accuracy, rounds, the resolved config, model_sha256 (of the
                   final global float32 buffer), bytes moved, timings (overhead_fraction =
                   share of wall time outside the parallel phase)
    model.npz      the final global buffer, layer table (JSON), model spec, round, the
                   strategy's state buffers and meta, the input normalisation
    curves.png     test accuracy and loss by round

Determinism: selection is seeded by (seed, round), each local round by (seed, round,
client) (`strategies.client_seed`), and aggregation visits clients in sorted order, so the
final model is bit-identical whatever the number of worker threads or their scheduling.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping

import numpy as np

from .errors import NonFiniteError
from .io import jsonable as _jsonable
from .roles.outputs import RoundExporter, write_outputs
from .roles.outputs import run_summary as _summary
from .roles.runner import PreparedRun, RunResult, prepare_run
from .rounds import RoundEngine, add_evaluation
from .runconfig import RunConfig
from .strategies import LocalData, Setup, Strategy

# Moved to lower layers (docs/architecture.md "Layers"), and still importable from here for
# the callers that do so today: the CLI (`edgefl client --partition`, `edgefl export`) and
# the tests.
from .checkpoint import load_checkpoint, model_sha256  # noqa: F401
from .roles.outputs import absolute_dataset_paths as _absolute_paths  # noqa: F401
from .roles.outputs import export_final_onnx as _export_onnx  # noqa: F401
from .roles.runner import client_shard, local_datasets, run_aggregator  # noqa: F401

log = logging.getLogger("edgefl.sim")

__all__ = ["RunResult", "run_federation", "simulate", "local_datasets", "model_sha256",
           "load_checkpoint", "Progress", "PreparedRun", "prepare_run", "client_shard",
           "run_over_broker", "run_aggregator", "write_outputs", "RoundExporter", "TRANSPORTS"]


def run_federation(strategy: Strategy, init_params: np.ndarray, clients: Mapping[int, LocalData],
                   setup: Setup, clients_per_round: int, *, rounds: int | None = None,
                   test: tuple | None = None, eval_every: int = 1, workers: int | None = None,
                   on_round: Callable[[dict], None] | None = None,
                   on_model: Callable[[int, np.ndarray], None] | None = None) -> RunResult:
    """Run `rounds` (default setup.rounds) rounds of `strategy` over in-memory `clients`.

    The rounds are the round engine's (edgefl.rounds): each selects `clients_per_round` of
    setup.clients, trains every client the strategy tasks (FedUmf tasks unselected clients
    too) -- here, in a thread pool --, passes the uploads of tasks with upload=True to
    `aggregate` in sorted client order, and evaluates the global model on `test` = (x, y)
    every `eval_every` rounds and after the last. `on_round(record)` sees
    each round's metrics once it is done and evaluated (with several threads a round's
    evaluation overlaps the next round's training, so its record comes then; records still
    come in round order), `on_model(round, global model)` its model as soon as it is
    aggregated (the periodic ONNX export).
    """
    rounds = setup.rounds if rounds is None else rounds
    missing = sorted(set(setup.clients) - set(clients))
    if missing:
        raise ValueError(f"run_federation: no local data for client(s) {missing[:10]}")
    model = clients[setup.clients[0]].model
    if not setup.units:   # the server knows the architecture (FedMR recombines per layer)
        setup = dataclasses.replace(setup, units=Setup.units_of(model))
    workers = (os.cpu_count() or 1) if workers is None else int(workers)
    if workers < 1:
        raise ValueError(f"workers = {workers}: need at least 1 thread")
    engine = RoundEngine.for_run(strategy, setup, model, clients_per_round, rounds=rounds,
                                 eval_every=eval_every, test=test)
    state = strategy.init(init_params, setup)
    client_states: dict = {c: None for c in setup.clients}
    history = []
    started = time.perf_counter()
    # workers - 1 pool threads: the calling thread trains clients too
    pool = ThreadPoolExecutor(max_workers=workers - 1, thread_name_prefix="edgefl-client") \
        if workers > 1 else None
    # With more than one thread, the evaluation of round r's model runs as one more work item
    # of round r+1's training phase instead of between the rounds, where it kept all but one
    # core idle (issue #3's overhead target); its record reaches on_round when that phase
    # ends. The last round is evaluated at once. The model is the read-only State buffer of
    # round r, so the result is the same either way.
    pending = None                  # the ClosedRound whose evaluation is deferred

    def finish(record) -> None:
        history.append(record)
        if on_round is not None:
            on_round(record)

    try:
        for r in range(1, rounds + 1):
            plan = engine.open_round(r, state)
            tasks = plan.tasks
            order = sorted(tasks)
            evaluating = pending

            def work_item(c, r=r, tasks=tasks, evaluating=evaluating):
                if c is _EVALUATE:
                    return engine.evaluate(evaluating.model)
                try:
                    return strategy.train(tasks[c], clients[c], client_states[c])
                except NonFiniteError as exc:
                    raise NonFiniteError(exc.step, f"round {r}, client {c}: {exc}") from exc

            t1 = time.perf_counter()
            results = _map_clients(pool, workers, work_item,
                                   order if evaluating is None else [_EVALUATE] + order)
            train_wall = time.perf_counter() - t1
            if evaluating is not None:
                pending = None
                add_evaluation(evaluating.record, results[0])
                finish(evaluating.record)
                results = results[1:]
            updates = {}
            for c, (update, new_state) in zip(order, results):
                client_states[c] = new_state
                if engine.accept_upload(plan, c, update):
                    updates[c] = update
            closed = engine.close_round(plan, updates, state, train_wall_s=train_wall,
                                        elapsed_before=plan.started - started,
                                        defer_evaluation=pool is not None and r != rounds)
            state = closed.state
            if closed.evaluation_pending:
                pending = closed
            else:
                finish(closed.record)
            if on_model is not None:
                on_model(r, closed.model)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    return RunResult(state, client_states, history, strategy.global_model(state))


_EVALUATE = object()      # the work item of run_federation's deferred evaluation


def _map_clients(pool: ThreadPoolExecutor | None, workers: int, fn: Callable, items: list) -> list:
    """[fn(item) for item in items] on `workers` threads: the pool's and the caller's.

    Each thread takes the next unclaimed item until none is left, so a round costs one
    hand-off per thread instead of one future per client (pool.map's ~20 us each was ~6% of a
    digits round). The result list is in item order whatever thread computed what, and when
    clients fail the one earliest in `items` is raised, so errors are deterministic too."""
    if pool is None or len(items) < 2:
        return [fn(item) for item in items]
    results: list = [None] * len(items)
    errors: dict = {}
    claim = itertools.count()          # next() on a count is atomic under the GIL

    def work() -> None:
        for i in iter(claim.__next__, None):
            if i >= len(items):
                return
            try:
                results[i] = fn(items[i])
            except BaseException as exc:      # re-raised below, on the calling thread
                errors[i] = exc

    helpers = [pool.submit(work) for _ in range(min(workers, len(items)) - 1)]
    work()
    for future in helpers:
        future.result()
    if errors:
        raise errors[min(errors)]
    return results


# ---------------------------------------------------------------------------------------
# the same rounds through an MQTT broker
# ---------------------------------------------------------------------------------------

def run_over_broker(run: "PreparedRun", url: str | None = None, *, broker_kind: str = "auto",
                    workers: int | None = None, on_round: Callable[[dict], None] | None = None,
                    on_model: Callable[[int, np.ndarray], None] | None = None,
                    max_payload: int = 128 * 1024, compression: str = "none",
                    round_timeout_s: float = 120.0, federation: str | None = None,
                    state_dir: str | None = None, connect_timeout: float = 30.0):
    """Run `run` through an MQTT broker: the aggregator role in this thread and one client
    role per shard in its own thread, each with its own MQTT connection, as a fleet would
    (edgefl.roles). url: the broker (None: an EmbeddedBroker of `broker_kind` for the run).
    At most `workers` clients train at once. Returns (RunResult, a description of the
    transport for the summary). The final model equals run_federation's bit for bit when
    compression is "none"."""
    import tempfile
    import threading

    from .roles import (Aggregator, AggregatorSettings, Client, ClientSettings, RunPlan,
                        default_client_ids)
    from .transport.broker import EmbeddedBroker, packet_bytes_for
    from .transport.mqtt import MqttTransport, parse_broker_url
    from .transport.netloop import NetworkLoop

    config = run.config
    federation = federation or f"sim-{os.urandom(4).hex()}"   # fresh topics: no leftovers
    ids = default_client_ids(len(run.setup.clients))
    workers = (os.cpu_count() or 1) if workers is None else int(workers)
    if url is not None:
        parse_broker_url(url)                      # a bad URL fails before anything starts
    stop = threading.Event()
    slots = threading.Semaphore(max(1, workers))
    errors: list = []
    broker, scratch, roles, threads = None, None, [], []
    # One network thread for every role's connection instead of one each: eleven roles of
    # one process otherwise wake two threads per message (docs/scaling.md).
    network = NetworkLoop(name=f"edgefl-{federation}-net")
    try:
        if url is None:
            broker = EmbeddedBroker(kind=broker_kind,
                                    max_packet_bytes=packet_bytes_for(max_payload)).start()
            url = broker.url
        address = parse_broker_url(url)
        if state_dir is None:
            scratch = tempfile.TemporaryDirectory(prefix="edgefl-sim-")
        root = scratch.name if scratch is not None else state_dir

        def transport(node):
            return MqttTransport(url, f"edgefl-{federation}-{node}", clean_session=True,
                                 connect_timeout=connect_timeout, reconnect_min=0.1,
                                 reconnect_max=2.0, network_loop=network)

        for c, node in enumerate(ids):
            data = run.clients[c]
            role = Client(ClientSettings(node, federation, max_payload=max_payload,
                                         compression=compression, exit_when_finished=True,
                                         raise_on_error=True),
                          (data.x, data.y), transport(node), os.path.join(root, node),
                          stop=stop, train_slots=slots)

            def body(role=role):
                try:
                    role.run()
                except BaseException as exc:       # noqa: BLE001 -- re-raised below
                    errors.append(exc)
                    stop.set()

            thread = threading.Thread(target=body, name=f"edgefl-{node}", daemon=True)
            thread.start()
            roles.append(role)
            threads.append(thread)
        deadline = time.monotonic() + connect_timeout
        for role in roles:
            while not role.ready.wait(0.05):
                if errors or time.monotonic() > deadline:
                    stop.set()
                    if errors:
                        raise errors[0]
                    raise TimeoutError(f"simulation clients did not connect to {address} "
                                       f"within {connect_timeout:g} s")
        plan = RunPlan(run.strategy, run.init_params, run.setup, run.model,
                       config.clients_per_round, ids,
                       test=(run.dataset.x_test, run.dataset.y_test),
                       eval_every=config.eval_every, description=config.to_dict())
        settings = AggregatorSettings(federation=federation, round_timeout_s=round_timeout_s,
                                      max_payload=max_payload, compression=compression)
        def after_round(record, history):
            if on_round is not None:
                on_round(record)
            if on_model is not None:
                on_model(record["round"], aggregator.plan.strategy.global_model(
                    aggregator.ckpt.state))

        aggregator = Aggregator(plan, transport("aggregator"), os.path.join(root, "aggregator"),
                                settings, stop=stop, on_round=after_round)
        result = aggregator.run()
        for thread in threads:
            thread.join(timeout=30.0)
        if errors:
            raise errors[0]
        if not result.finished:
            raise RuntimeError(f"simulation over {address} stopped after round "
                               f"{len(result.history)} of {run.setup.rounds}")
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=10.0)
        network.close()
        if broker is not None:
            broker.stop()
        if scratch is not None:
            scratch.cleanup()
    client_states = {c: role.client_state for c, role in enumerate(roles)}
    info = {"name": "mqtt", "broker": str(address),
            "broker_kind": broker.kind if broker is not None else "external",
            "federation": federation, "max_payload": max_payload, "compression": compression,
            "run_id": result.run_id, "late": result.stats["late"],
            "duplicates": result.stats["duplicates"], "rejected": result.stats["rejected"],
            "resends": result.stats["resends"]}
    return RunResult(result.state, client_states, result.history, result.params), info


# ---------------------------------------------------------------------------------------
# simulate: a RunConfig to an output directory
# ---------------------------------------------------------------------------------------

TRANSPORTS = ("inproc", "mqtt")


def simulate(config: RunConfig, out_dir: str | os.PathLike | None, *, workers: int | None = None,
             progress: bool | None = None, stream=None, transport: str = "inproc",
             broker: str | None = None, broker_kind: str = "auto",
             mqtt: Mapping | None = None, export=None) -> dict:
    """Run the configured federation and write metrics.jsonl, summary.json, model.npz and
    curves.png into `out_dir` (None: write nothing). progress: None = show a progress bar on
    stderr (a bar on a TTY, one line per round otherwise), False = silent. Returns the
    summary dict.

    transport "inproc" (default) runs `run_federation`; "mqtt" runs the same rounds through
    a broker -- `broker` (a URL), or an EmbeddedBroker of `broker_kind` started for the run --
    with the aggregator and one client per partition shard as threads of this process
    (`run_over_broker`; `mqtt`: its keyword options). Both give the same final model.

    export: an edgefl.export.ExportPolicy; out_dir/model.onnx is the final model, replaced
    atomically after every `export.every`-th round too (None: the final model only)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport {transport!r}; valid: {', '.join(TRANSPORTS)}")
    if transport == "inproc" and broker is not None:
        raise ValueError("a broker URL needs transport 'mqtt'")
    run = prepare_run(config, workers=workers, out_dir=out_dir, progress=progress,
                      stream=stream)
    dataset, model, strategy = run.dataset, run.model, run.strategy
    init_params, clients, setup = run.init_params, run.clients, run.setup
    workers = (os.cpu_count() or 1) if workers is None else int(workers)

    metrics_file = None
    if out_dir is not None:
        out_dir = os.fspath(out_dir)
        os.makedirs(out_dir, exist_ok=True)
        metrics_file = open(os.path.join(out_dir, "metrics.jsonl"), "w", encoding="utf-8")
    bar = Progress(config.rounds, stream or sys.stderr, enabled=progress is not False)
    exporter = RoundExporter(run, out_dir, export, stream or sys.stderr, "edgefl simulate") \
        if out_dir is not None else None

    def on_round(record):
        if metrics_file is not None:
            metrics_file.write(json.dumps(_jsonable(record)) + "\n")
            metrics_file.flush()
        bar.update(record)

    broker_info = None
    try:
        if transport == "inproc":
            result = run_federation(strategy, init_params, clients, setup,
                                    config.clients_per_round,
                                    test=(dataset.x_test, dataset.y_test),
                                    eval_every=config.eval_every, workers=workers,
                                    on_round=on_round, on_model=exporter)
        else:
            result, broker_info = run_over_broker(run, broker, broker_kind=broker_kind,
                                                  workers=workers, on_round=on_round,
                                                  on_model=exporter, **dict(mqtt or {}))
    finally:
        bar.close()
        if metrics_file is not None:
            metrics_file.close()

    summary = _summary(config, model, result, workers)
    if broker_info is not None:
        summary["transport"] = broker_info
    if exporter is not None and exporter.exported:
        summary["onnx_exports"] = list(exporter.exported)
    if out_dir is not None:
        write_outputs(out_dir, config, model, strategy, result, dataset, summary,
                      stream or sys.stderr, "edgefl simulate",
                      onnx_exported=exporter.last_round == config.rounds,
                      export=exporter.policy)
    return summary


# ---------------------------------------------------------------------------------------
# progress on stderr
# ---------------------------------------------------------------------------------------

class Progress:
    """Round, accuracy and ETA on a stream: a redrawn bar when it is a TTY, one line per
    round otherwise; nothing when disabled (--quiet)."""

    WIDTH = 24

    def __init__(self, total: int, stream, enabled: bool = True):
        self.total, self.stream, self.enabled = total, stream, enabled
        self.tty = enabled and hasattr(stream, "isatty") and stream.isatty()
        self.last_accuracy = None
        self.drawn = False

    def update(self, record: dict) -> None:
        if not self.enabled:
            return
        r, elapsed = record["round"], record["elapsed_s"]
        if record["test_accuracy"] is not None:
            self.last_accuracy = record["test_accuracy"]
        eta = elapsed / r * (self.total - r)
        acc = "  -   " if self.last_accuracy is None else f"{self.last_accuracy:.4f}"
        loss = record["train_loss"]
        loss = "nan" if loss is None or not math.isfinite(loss) else f"{loss:.4f}"
        if self.tty:
            filled = self.WIDTH * r // self.total
            bar = "#" * filled + "-" * (self.WIDTH - filled)
            self.stream.write(f"\rround {r:>{len(str(self.total))}}/{self.total} [{bar}] "
                              f"acc {acc}  train loss {loss}  ETA {_duration(eta)} ")
            self.drawn = True
        else:
            self.stream.write(f"round {r}/{self.total} acc {acc} train_loss {loss} "
                              f"{record['wall_s']:.3f}s ETA {_duration(eta)}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    m, s = divmod(seconds, 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"
