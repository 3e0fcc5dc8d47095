"""In-process simulation: the aggregator and N virtual clients in one process
(DESIGN.md "Who uses it" 1; issue #3 item 4).

`run_federation` is the round loop over in-memory clients: select -> configure -> train the
tasked clients in a thread pool (the C core releases the GIL) -> aggregate in sorted client
order -> evaluate. `run_over_broker` runs the same rounds through an MQTT broker with the
real roles (edgefl.roles: the aggregator and one client per shard, each with its own
connection, as threads of this process), and `run_aggregator` is `edgefl aggregator`.
`simulate` wraps either for a RunConfig (`transport="inproc"` or `"mqtt"`): loads the
dataset, partitions it, builds the model, and writes to an output directory

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
import hashlib
import itertools
import json
import logging
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from . import __version__, kernels
from .config import ConfigError, dataset_from_config, partition_from_config
from .errors import KernelError, NonFiniteError
from .models import Model, build_model
from .runconfig import RunConfig
from .strategies import (LocalData, PrepareContext, Setup, State, Strategy, get_strategy,
                         mean_train_loss, select_clients)

log = logging.getLogger("edgefl.sim")

__all__ = ["RunResult", "run_federation", "simulate", "local_datasets", "model_sha256",
           "load_checkpoint", "Progress", "PreparedRun", "prepare_run", "client_shard",
           "run_over_broker", "run_aggregator", "write_outputs", "RoundExporter", "TRANSPORTS"]


@dataclass
class RunResult:
    state: State                      # the server state after the last round
    client_states: dict               # {client: State | None}
    history: list = field(default_factory=list)   # one metrics dict per round
    params: np.ndarray | None = None  # strategy.global_model(state)

    @property
    def model_sha256(self) -> str:
        return model_sha256(self.params)


def model_sha256(params: np.ndarray) -> str:
    """sha256 of the float32 buffer's bytes."""
    return hashlib.sha256(np.ascontiguousarray(params, dtype=np.float32).tobytes()).hexdigest()


def local_datasets(dataset, split, model: Model) -> dict:
    """{client: LocalData} for a Dataset and a Partition (per-client labels when the
    partitioner replaced them, as label-noise does)."""
    out = {}
    for c, idx in enumerate(split.indices):
        y = split.labels[c] if split.labels is not None else dataset.y_train[idx]
        out[c] = LocalData(c, model, np.ascontiguousarray(dataset.x_train[idx]),
                           np.ascontiguousarray(y))
    return out


def run_federation(strategy: Strategy, init_params: np.ndarray, clients: Mapping[int, LocalData],
                   setup: Setup, clients_per_round: int, *, rounds: int | None = None,
                   test: tuple | None = None, eval_every: int = 1, workers: int | None = None,
                   on_round: Callable[[dict], None] | None = None,
                   on_model: Callable[[int, np.ndarray], None] | None = None) -> RunResult:
    """Run `rounds` (default setup.rounds) rounds of `strategy` over in-memory `clients`.

    Each round selects `clients_per_round` of setup.clients, trains every client the
    strategy tasks (FedUmf tasks unselected clients too), passes the uploads of tasks with
    upload=True to `aggregate` in sorted client order, and evaluates the global model on
    `test` = (x, y) every `eval_every` rounds and after the last. `on_round(record)` sees
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
    test_set = None if test is None else kernels.Samples(model, *test)   # checked once
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
    pending = None                  # (record, model) of a round whose evaluation is deferred

    def finish(record, evaluation) -> None:
        if evaluation is not None:
            record["test_accuracy"], record["test_loss"] = \
                evaluation["accuracy"], evaluation["loss"]
        history.append(record)
        if on_round is not None:
            on_round(record)

    try:
        for r in range(1, rounds + 1):
            t0 = time.perf_counter()
            selected = select_clients(setup.seed, r, setup.clients, clients_per_round)
            tasks = strategy.configure(r, selected, state)
            order = sorted(tasks)
            evaluating = pending

            def work_item(c, r=r, tasks=tasks, evaluating=evaluating):
                if c is _EVALUATE:
                    return kernels.evaluate_samples(test_set, evaluating[1])
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
                finish(evaluating[0], results[0])
                results = results[1:]
            updates = {}
            for c, (update, new_state) in zip(order, results):
                client_states[c] = new_state
                if tasks[c].upload:
                    updates[c] = update
                elif update.buffers:
                    raise RuntimeError(f"{strategy.name}: client {c} was not allowed to upload in "
                                       f"round {r} but its update carries buffers "
                                       f"{sorted(update.buffers)}")
            state, metrics = strategy.aggregate(r, updates, state)
            train_loss = metrics.pop("train_loss") if "train_loss" in metrics \
                else mean_train_loss(updates)
            record = {"round": r, "test_accuracy": None, "test_loss": None,
                      "train_loss": train_loss,
                      "uplink_bytes": sum(u.nbytes for u in updates.values()),
                      "downlink_bytes": sum(t.nbytes for t in tasks.values()),
                      "selected": list(selected), "trained": len(tasks)}
            model_r = strategy.global_model(state)
            evaluate = test is not None and (r % eval_every == 0 or r == rounds)
            evaluation = None
            if evaluate and (pool is None or r == rounds):
                evaluation = kernels.evaluate_samples(test_set, model_r)
            now = time.perf_counter()
            record.update({"wall_s": now - t0, "train_wall_s": train_wall,
                           "elapsed_s": now - started})
            record.update(metrics)
            if evaluate and evaluation is None:
                pending = (record, model_r)
            else:
                finish(record, evaluation)
            if on_model is not None:
                on_model(r, model_r)
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


def run_aggregator(config: RunConfig, transport, state_dir: str, *, settings,
                   client_ids=None, out_dir: str | None = None, workers: int | None = None,
                   stop=None, notifier=None, stream=None, export=None,
                   publish_onnx: bool = True, onnx_record_dir: str | None = None,
                   control=None) -> dict | None:
    """`edgefl aggregator`: run (or resume) the configured run over `transport` with the
    state in `state_dir`, rewriting out_dir/metrics.jsonl after every round and writing
    summary.json, model.npz (+ onnx, curves) when the run finishes. Returns the summary, or
    None when stopped before the end.

    export: an edgefl.export.ExportPolicy (default: the final model only). Each exported
    round's model replaces out_dir/model.onnx (state_dir/model.onnx without out_dir)
    atomically and, with publish_onnx, is published retained on the `onnx` topic for the
    clients (Aggregator.publish_onnx) while the aggregator is still connected;
    onnx_record_dir: where the part count of the federation's last publication is kept
    (default state_dir; the aggregator service passes its own directory, shared by its runs,
    so a new run clears the parts an earlier run's longer model left)."""
    from .roles import Aggregator, AggregatorCheckpoint, RunPlan, default_client_ids

    stream = stream or sys.stderr
    ckpt = AggregatorCheckpoint.load(state_dir)
    strategy = None
    if ckpt is not None:      # the strategy as the run used it (DUW's table is not retrained)
        strategy = get_strategy(ckpt.strategy["name"], **ckpt.strategy["params"])
    run = prepare_run(config, workers=workers, out_dir=out_dir, progress=False, stream=stream,
                      strategy=strategy)
    ids = tuple(client_ids) if client_ids else default_client_ids(len(run.setup.clients))
    if len(ids) != len(run.setup.clients):
        raise ConfigError(f"{config.path or '<config>'}: partition.clients = "
                          f"{len(run.setup.clients)} but {len(ids)} client ids were given")
    plan = RunPlan(run.strategy, run.init_params, run.setup, run.model,
                   config.clients_per_round, ids, test=(run.dataset.x_test, run.dataset.y_test),
                   eval_every=config.eval_every, description=config.to_dict())
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)

    exporter = RoundExporter(run, out_dir or state_dir, export, stream, "edgefl aggregator")

    def on_round(record, history):
        if out_dir is not None:
            from .roles.state import atomic_write
            atomic_write(os.path.join(out_dir, "metrics.jsonl"),
                         "".join(json.dumps(_jsonable(h)) + "\n" for h in history).encode())
        path = exporter(record["round"], aggregator.plan.strategy.global_model(
            aggregator.ckpt.state))
        if path is not None and publish_onnx:
            from .transport.base import TransportError
            try:
                aggregator.publish_onnx(path, record_dir=onnx_record_dir)
            except (TransportError, ValueError, OSError) as exc:
                log.error("round %d: the exported model was not published: %s",
                          record["round"], exc)

    aggregator = Aggregator(plan, transport, state_dir, settings, on_round=on_round, stop=stop,
                            notifier=notifier, control=control)   # control: roles/daemon.py
    result = aggregator.run()
    if not result.finished:
        return None
    run_result = RunResult(result.state, {}, result.history, result.params)
    summary = _summary(config, run.model, run_result, workers or 1)
    summary["transport"] = {"name": "mqtt", "federation": settings.federation,
                            "run_id": result.run_id, "aggregated_rounds": result.aggregated}
    if exporter.exported:
        summary["onnx_exports"] = list(exporter.exported)
    if out_dir is not None:
        write_outputs(out_dir, config, run.model, run.strategy, run_result, run.dataset,
                      summary, stream, "edgefl aggregator",
                      onnx_exported=exporter.last_round == config.rounds,
                      export=exporter.policy)
    return summary


# ---------------------------------------------------------------------------------------
# simulate: a RunConfig to an output directory
# ---------------------------------------------------------------------------------------

@dataclass
class PreparedRun:
    """A RunConfig made concrete: data, split, model, initial parameters, the strategy (after
    its offline phase, e.g. DUW's table), the Setup (units filled in) and each client's
    LocalData. What `simulate` and `edgefl aggregator` start from."""
    config: RunConfig
    dataset: object
    split: object
    model: Model
    init_params: np.ndarray
    strategy: Strategy
    setup: Setup
    clients: dict


def build_run_model(config: RunConfig, dataset) -> Model:
    model_spec = {k: v for k, v in config.model.items() if k != "init"}
    try:
        return build_model(model_spec, dataset.input_shape, dataset.num_classes)
    except KernelError as exc:
        raise ConfigError(f"{config.path or '<config>'}: model: {exc}") from None


def prepare_run(config: RunConfig, *, workers: int | None = None, out_dir=None,
                progress: bool | None = None, stream=None,
                strategy: Strategy | None = None,
                out_files: Mapping[str, str] | None = None) -> PreparedRun:
    """Load the dataset, partition it, build the model and its seeded initial buffer, and
    the strategy; run the strategy's offline phase (`Strategy.prepare`, e.g. DUW's table)
    unless a ready `strategy` is given (a resumed aggregator takes it from its checkpoint).
    What the phase writes goes to out_dir, or to out_files {name: path} (duw-train --out)."""
    dataset = dataset_from_config(config.as_config())
    split = partition_from_config(config.as_config(), dataset)
    model = build_run_model(config, dataset)
    init_params = model.init(config.seed, zero=config.model.get("init") == "zeros")
    setup = Setup(clients=range(len(split.indices)), train=config.train.kernel_kwargs(),
                  lr_decay=config.train.lr_decay, seed=config.seed, rounds=config.rounds,
                  units=Setup.units_of(model))
    clients = local_datasets(dataset, split, model)
    workers = (os.cpu_count() or 1) if workers is None else int(workers)
    if strategy is None:
        strategy = get_strategy(config.strategy, **config.strategy_params)
        context = PrepareContext(
            where=config.path or "<config>", clients_per_round=config.clients_per_round,
            base_dir=os.path.dirname(os.path.abspath(config.path)) if config.path else None,
            record=config.to_dict(), out_dir=None if out_dir is None else os.fspath(out_dir),
            out_files=dict(out_files or {}), workers=workers,
            stream=None if progress is False else (stream or sys.stderr))
        strategy = strategy.prepare(init_params, clients, setup, context)
    if config.attack is not None and strategy.name != "attacked":   # (a checkpoint's is already)
        from .attacks import with_attack      # malicious clients' uploads (edgefl.attacks)
        strategy = with_attack(strategy, config.attack, setup.clients)
    return PreparedRun(config, dataset, split, model, init_params, strategy, setup, clients)


def client_shard(config: RunConfig, index: int) -> tuple:
    """(x, y) of client `index` under the config's dataset and partition: what the
    in-process simulation gives that client, for a test or simulation fleet whose clients
    are separate processes (`edgefl client --partition CONFIG --shard INDEX`)."""
    dataset = dataset_from_config(config.as_config())
    split = partition_from_config(config.as_config(), dataset)
    n = len(split.indices)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
        raise ConfigError(f"{config.path or '<config>'}: shard {index!r}: the partition has "
                          f"clients 0..{n - 1}")
    idx = split.indices[index]
    y = split.labels[index] if split.labels is not None else dataset.y_train[idx]
    return np.ascontiguousarray(dataset.x_train[idx]), np.ascontiguousarray(y)


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


def write_outputs(out_dir: str, config: RunConfig, model: Model, strategy: Strategy,
                  result: RunResult, dataset, summary: dict, stream, who: str, *,
                  onnx_exported: bool = False, export=None) -> None:
    """summary.json, model.npz, model.onnx (with the export extra; unless a RoundExporter
    exported the final round already; `export`, the run's ExportPolicy, says how) and
    curves.png."""
    _write_json(os.path.join(out_dir, "summary.json"), summary)
    save_checkpoint(os.path.join(out_dir, "model.npz"), model, strategy, result, dataset,
                    dataset_config=_absolute_paths(config.dataset, config.path))
    if not onnx_exported:
        _export_onnx(out_dir, stream, export)
    try:
        plot_curves(result.history, os.path.join(out_dir, "curves.png"),
                    f"{config.strategy} on {dataset.name}, {config.clients} clients")
    except ImportError as exc:   # matplotlib is an optional extra
        print(f"{who}: curves.png skipped: {exc}", file=stream)


def _summary(config: RunConfig, model: Model, result: RunResult, workers: int) -> dict:
    evaluated = [h for h in result.history if h["test_accuracy"] is not None]
    best = max(evaluated, key=lambda h: h["test_accuracy"])
    last = result.history[-1]
    wall = last["elapsed_s"]
    train = sum(h["train_wall_s"] for h in result.history)
    return {
        "final_accuracy": last["test_accuracy"],
        "final_loss": last["test_loss"],
        "best_accuracy": best["test_accuracy"],
        "best_round": best["round"],
        "rounds": len(result.history),
        "model_sha256": result.model_sha256,
        "n_params": model.n_params,
        "uplink_bytes": sum(h["uplink_bytes"] for h in result.history),
        "downlink_bytes": sum(h["downlink_bytes"] for h in result.history),
        "wall_s": wall,
        "train_wall_s": train,
        "overhead_fraction": (wall - train) / wall if wall > 0 else 0.0,
        "workers": workers,
        "backend": kernels.backend,
        "edgefl_version": __version__,
        "config": config.to_dict(),
    }


def _absolute_paths(dataset_section, config_path) -> dict:
    """The dataset section with relative path/test_path resolved against the config file, so a
    checkpoint names data that `edgefl export` can find from any directory."""
    section = dict(dataset_section)
    base = os.path.dirname(os.path.abspath(config_path)) if config_path else os.getcwd()
    for key in ("path", "test_path"):
        if isinstance(section.get(key), str) and not os.path.isabs(section[key]):
            section[key] = os.path.normpath(os.path.join(base, section[key]))
    return section


class RoundExporter:
    """Exports the global model of the rounds an ExportPolicy names (every N-th and the last)
    to out_dir/model.onnx by atomic replace, from the live parameters and the run's loaded
    dataset (normalisation, class names; the test set gives the accuracy in the metadata).
    Called as on_model(round, params); returns the path when it exported. Without the
    `onnx` package (the export extra) it says so once and exports nothing; an export that
    fails is reported and the run goes on (its state is not at stake)."""

    def __init__(self, run: "PreparedRun", out_dir: str, policy, stream, who: str):
        from .export import ExportPolicy

        self.run = run
        self.path = os.path.join(os.fspath(out_dir), "model.onnx")
        self.policy = policy if policy is not None else ExportPolicy()
        self.stream = stream
        self.who = who
        self.exported: list = []             # [{round, bytes, accuracy}] of this process
        self.last_round: int | None = None
        self._unavailable = False

    def __call__(self, round: int, params) -> str | None:
        if self._unavailable or not self.policy.due(round, self.run.config.rounds):
            return None
        try:
            from .export import ExportError, export_run, run_from_params
        except ImportError as exc:     # pragma: no cover - the export extra is missing
            self._unavailable = True
            print(f"{self.who}: model.onnx skipped ({exc}; pip install 'edgefl[export]')",
                  file=self.stream)
            return None
        config = self.run.config
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            live = run_from_params(self.run.model, np.ascontiguousarray(params, np.float32),
                                   round=round, algorithm=self.run.strategy.name,
                                   dataset=self.run.dataset,
                                   dataset_config=_absolute_paths(config.dataset, config.path))
            report = export_run(live, self.path, dataset=self.run.dataset,
                                softmax=self.policy.softmax,
                                quantize=None if self.policy.quantize == "none" else "int8")
        except (ExportError, ValueError, OSError) as exc:
            log.error("round %d: ONNX export to %s failed: %s", round, self.path, exc)
            return None
        accuracy = report["accuracy_int8"] if report["accuracy_int8"] is not None \
            else report["accuracy_fp32"]
        self.exported.append({"round": round, "bytes": report["bytes"], "accuracy": accuracy})
        self.last_round = round
        log.info("round %d: exported to %s (%d bytes%s)", round, self.path, report["bytes"],
                 f", test accuracy {accuracy:.4f}" if accuracy is not None else "")
        return self.path


def _export_onnx(out_dir: str, stream, policy=None) -> None:
    """model.onnx next to model.npz (atomic replace), when the optional onnx extra is present.

    Called by write_outputs after summary.json and model.npz are written, when no
    RoundExporter exported the final round (it failed, or the run had none). Like a
    RoundExporter's, a failed export is logged with its cause and the run goes on: the
    trained model is safe in model.npz, the rest of the outputs (curves.png) still get
    written, and `edgefl export <out_dir>` can retry. A model.onnx already there (an earlier
    round's export) is left as it was, and the message says so. `policy` (the run's
    ExportPolicy) gives the softmax output and quantisation, as the RoundExporter's would."""
    path = os.path.join(out_dir, "model.onnx")
    try:
        from .export import export_checkpoint
        if policy is None:
            export_checkpoint(out_dir, path)
        else:
            export_checkpoint(out_dir, path, softmax=policy.softmax,
                              quantize=None if policy.quantize == "none" else "int8")
    except ImportError as exc:
        print(f"{path} skipped ({exc}; pip install 'edgefl[export]')", file=stream)
    except (ValueError, OSError) as exc:
        # ValueError: export.ExportError, and infer's ModelFileError/InputError while the
        # export's accuracy is measured; OSError: the file system (a directory in the way,
        # a full disk, no write permission)
        left = ("; the model.onnx there, from an earlier export, is left as it was"
                if os.path.isfile(path) else "")
        log.error("final ONNX export to %s failed (%s: %s); summary.json and model.npz are "
                  "written, retry with `edgefl export %s`%s", path, type(exc).__name__, exc,
                  out_dir, left)


def save_checkpoint(path: str, model: Model, strategy: Strategy, result: RunResult, dataset=None,
                    dataset_config=None):
    """model.npz, written atomically (temporary file, fsync, rename). No pickles: strings are
    stored as numpy unicode scalars, so np.load(path) works with allow_pickle=False.
    dataset_config: the run's dataset section, so an export can reload the test data."""
    arrays = {
        "params": np.asarray(result.params),
        "table": np.array(json.dumps(model.table.to_json())),
        "model_spec": np.array(model.spec),
        "input_shape": np.array(model.input_shape, dtype=np.int64),
        "num_classes": np.array(model.num_classes, dtype=np.int64),
        "round": np.array(result.history[-1]["round"] if result.history else 0, dtype=np.int64),
        "strategy": np.array(json.dumps({"name": strategy.name, **strategy.hyperparameters()})),
        "state_meta": np.array(json.dumps(_jsonable(dict(result.state.meta)))),
    }
    for name, buf in result.state.buffers.items():
        arrays[f"state.{name}"] = np.asarray(buf)
    if dataset is not None:
        arrays["norm_mean"] = np.asarray(dataset.norm_mean)
        arrays["norm_std"] = np.asarray(dataset.norm_std)
        arrays["class_names"] = np.array(json.dumps(list(dataset.class_names)))
    if dataset_config is not None:
        arrays["dataset"] = np.array(json.dumps(_jsonable(dict(dataset_config))))
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: str) -> dict:
    """The arrays of a model.npz with its JSON fields decoded (table as a LayerTable)."""
    from .params import LayerTable

    with np.load(path, allow_pickle=False) as z:
        out = {k: z[k] for k in z.files}
    for key in ("table", "strategy", "state_meta", "class_names", "model_spec", "dataset"):
        if key in out:
            out[key] = json.loads(str(out[key]))
    out["table"] = LayerTable.from_json(out["table"])
    out["round"] = int(out["round"])
    return out


def plot_curves(history: list, path: str, title: str = "") -> None:
    """curves.png: test accuracy (left) and test/train loss (right) by round; matplotlib's
    Agg canvas directly, no pyplot state."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("curves.png needs matplotlib (pip install 'edgefl[plot]')") from exc
    evaluated = [h for h in history if h["test_accuracy"] is not None]
    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    acc, loss = fig.subplots(1, 2)
    acc.plot([h["round"] for h in evaluated], [h["test_accuracy"] for h in evaluated], marker=".")
    acc.set_xlabel("round")
    acc.set_ylabel("test accuracy")
    acc.grid(True, alpha=0.3)
    loss.plot([h["round"] for h in evaluated], [h["test_loss"] for h in evaluated], marker=".",
              label="test loss")
    loss.plot([h["round"] for h in history], [h["train_loss"] for h in history], marker=".",
              label="train loss (local steps)")
    loss.set_xlabel("round")
    loss.set_ylabel("loss")
    loss.grid(True, alpha=0.3)
    loss.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)


def _write_json(path: str, data) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_jsonable(data), f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def _jsonable(x):
    """Plain JSON types; NaN/inf become null (JSON has no NaN)."""
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


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
