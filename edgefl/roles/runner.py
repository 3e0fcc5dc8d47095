"""A run of a RunConfig: made concrete (`prepare_run`), and run by the aggregator role
(`run_aggregator`, what `edgefl aggregator` and its service run for each run).

`prepare_run` loads the data set, partitions it, builds the model and its seeded initial
buffer and the strategy (after its offline phase, e.g. DUW's table): a `PreparedRun`, what
`edgefl simulate` (edgefl.sim) starts from too. `run_aggregator` runs (or resumes) it as
the Aggregator role over a Transport and writes the run's outputs (roles.outputs). A run
ends in a `RunResult`: the server state, the clients' states, one record per round and the
global model.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field

import numpy as np

from ..checkpoint import model_sha256
from ..config import ConfigError, dataset_from_config, partition_from_config
from ..errors import KernelError
from ..io import atomic_write, jsonable
from ..models import Model, build_model
from ..runconfig import RunConfig
from ..strategies import LocalData, Setup, State, Strategy, get_strategy
from .aggregator import Aggregator, RunPlan, default_client_ids
from .outputs import RoundExporter, run_summary, write_outputs
from .state import AggregatorCheckpoint

log = logging.getLogger("edgefl.roles.runner")

__all__ = ["PreparedRun", "RunResult", "build_run_model", "client_shard", "local_datasets",
           "prepare_run", "run_aggregator"]


@dataclass
class RunResult:
    """How a run ended, in process or over a broker."""
    state: State                      # the server state after the last round
    client_states: dict               # {client: State | None}
    history: list = field(default_factory=list)   # one metrics dict per round
    params: np.ndarray | None = None  # strategy.global_model(state)

    @property
    def model_sha256(self) -> str:
        return model_sha256(self.params)


def local_datasets(dataset, split, model: Model) -> dict:
    """{client: LocalData} for a Dataset and a Partition (per-client labels when the
    partitioner replaced them, as label-noise does)."""
    out = {}
    for c, idx in enumerate(split.indices):
        y = split.labels[c] if split.labels is not None else dataset.y_train[idx]
        out[c] = LocalData(c, model, np.ascontiguousarray(dataset.x_train[idx]),
                           np.ascontiguousarray(y))
    return out


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
                strategy: Strategy | None = None) -> PreparedRun:
    """Load the dataset, partition it, build the model and its seeded initial buffer, and
    the strategy; run the strategy's offline phase (`prepare`, DUW's table) unless a ready
    `strategy` is given (a resumed aggregator takes it from its checkpoint)."""
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
        prepare = getattr(strategy, "prepare", None)   # an offline phase (DUW's table)
        if prepare is not None:
            strategy = prepare(init_params, clients, setup, config=config, out_dir=out_dir,
                               stream=None if progress is False else (stream or sys.stderr),
                               workers=workers)
    if config.attack is not None and strategy.name != "attacked":   # (a checkpoint's is already)
        from ..attacks import with_attack      # malicious clients' uploads (edgefl.attacks)
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
            atomic_write(os.path.join(out_dir, "metrics.jsonl"),
                         "".join(json.dumps(jsonable(h)) + "\n" for h in history))
        path = exporter(record["round"], aggregator.plan.strategy.global_model(
            aggregator.ckpt.state))
        if path is not None and publish_onnx:
            from ..transport.base import TransportError
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
    summary = run_summary(config, run.model, run_result, workers or 1)
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
