"""The aggregator role's run of a RunConfig (`run_aggregator`): what `edgefl aggregator` and
its service (roles/daemon.py) run for each run. It prepares the run (edgefl.runs.prepare),
runs or resumes it as the Aggregator over a Transport, and writes the run's outputs
(edgefl.runs.outputs), as `edgefl simulate` does for an in-process run.

A warm start (model.init naming an earlier run's model) is recorded in the state directory
(WARM_START_FILE: the checkpoint read, its parameters' sha256, its round) when the run
starts, so that a resume needs the file no more: once the run has a checkpoint, the file is
read and checked when it is there, and when it is gone the run goes on from its checkpoint
with the recorded hash in its fingerprint (`_prepare`).
"""
from __future__ import annotations

import json
import logging
import os
import sys

from ..errors import ConfigError, RunStopped, TrainingStopped
from ..io import atomic_write, jsonable, write_json
from ..kernels import StopFlag
from ..runconfig import RunConfig
from ..runs.outputs import RoundExporter, run_summary, stopped_summary, write_outputs
from ..runs.prepare import RunResult, prepare_run
from ..strategies import get_strategy
from ..virtual_fleet import refuse_over_broker
from .aggregator import RunPlan, default_client_ids, run_fingerprint, secure_plan
from .asynchronous import aggregator_class
from .state import AggregatorCheckpoint, StateError, read_json
from .state import write_json as write_state_json

log = logging.getLogger("edgefl.roles.runner")

__all__ = ["WARM_START_FILE", "run_aggregator", "run_edge"]

# in the run's state directory: model.init's checkpoint as the run started from it
WARM_START_FILE = "warm_start.json"


def run_aggregator(config: RunConfig, transport, state_dir: str, *, settings,
                   client_ids=None, out_dir: str | None = None, workers: int | None = None,
                   stop=None, notifier=None, stream=None, export=None,
                   publish_onnx: bool = True, onnx_record_dir: str | None = None,
                   control=None, sites=None) -> dict | None:
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
    so a new run clears the parts an earlier run's longer model left).

    sites: {edge id: its clients' node ids}: the run's rounds go to edge aggregators
    (roles/edge.py, `CentralAggregator`) instead of to the clients."""
    refuse_over_broker(config)           # before anything is loaded or connected
    stream = stream or sys.stderr
    ckpt = AggregatorCheckpoint.load(state_dir)
    strategy = None
    if ckpt is not None:      # the strategy as the run used it (DUW's table is not retrained)
        strategy = get_strategy(ckpt.strategy["name"], **ckpt.strategy["params"])
    if sites:                 # before the data and a strategy's offline phase (DUW's table)
        _refuse_edges(config, strategy)
    # a strategy's offline phase (DUW's table) trains too: the service's signal stops it
    # within one local step, and the run, not started, is taken up again after a restart
    kernel_stop = next((e for e in getattr(stop, "events", [stop])
                        if isinstance(e, StopFlag)), None)
    try:
        run, recorded = _prepare(config, state_dir, ckpt, workers=workers, out_dir=out_dir,
                                 progress=False, stream=stream, strategy=strategy,
                                 stop=kernel_stop)
    except TrainingStopped:
        log.info("stopped while the run was being prepared")
        return None
    ids = tuple(client_ids) if client_ids else default_client_ids(len(run.setup.clients))
    if len(ids) != len(run.setup.clients):
        raise ConfigError(f"{config.path or '<config>'}: partition.clients = "
                          f"{len(run.setup.clients)} but {len(ids)} client ids were given")
    plan = RunPlan(run.strategy, run.init_params, run.setup, run.model,
                   config.clients_per_round, ids, test=(run.dataset.x_test, run.dataset.y_test),
                   eval_every=config.eval_every, description=config.to_dict(),
                   hooks=run.hooks, **secure_plan(run),
                   init_sha256=None if recorded is None else recorded["model_sha256"])
    if run.warm_start is not None and recorded is None and (
            ckpt is None or run_fingerprint(plan, settings) == ckpt.fingerprint):
        # the first start, or a checkpoint of before the record with its own file
        write_state_json(os.path.join(state_dir, WARM_START_FILE), run.warm_start)
    if ckpt is not None and hasattr(run.hooks, "resume"):   # an adaptive clip goes on
        run.hooks.resume(ckpt.history)
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

    if sites:
        from .edge import CentralAggregator
        aggregator = CentralAggregator(plan, transport, state_dir, settings, sites=sites,
                                       on_round=on_round, stop=stop, notifier=notifier,
                                       control=control)
    else:
        aggregator = aggregator_class(plan)(plan, transport, state_dir, settings,
                                            on_round=on_round, stop=stop, notifier=notifier,
                                            control=control)   # control: roles/daemon.py
    result = aggregator.run()
    if not result.finished:
        if control is not None and control.stop_requested.is_set() and out_dir is not None:
            # the operator's stop ends the run for good (an interrupted service resumes it):
            # summary.json of the rounds done, as simulate writes for a stopped run, so that
            # `edgefl compare` and `export` read it like any other run's
            stopped = RunStopped(len(result.history) + 1,
                                 RunResult(result.state, {}, result.history, result.params),
                                 config.rounds)
            write_json(os.path.join(out_dir, "summary.json"),
                       stopped_summary(config, run.model, stopped, workers or 1), indent=2)
        return None
    run_result = RunResult(result.state, {}, result.history, result.params, result.stopped)
    summary = run_summary(config, run.model, run_result, workers or 1)
    if run.warm_start is not None:
        summary["init"] = run.warm_start
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


def _prepare(config: RunConfig, state_dir: str, ckpt, **options) -> tuple:
    """(prepare_run's PreparedRun, the warm start recorded in state_dir or None). A run
    with a checkpoint and a recorded warm start is the run that started from the recorded
    model: the file is read when it is there and holds that model; when it is gone, or now
    holds another model (a link moved on, a copy over it), the run is prepared without it
    (a seeded stand-in, never used: the checkpoint holds the model), warned about, and the
    record returned, for the fingerprint's hash and the summary's `init`. A checkpoint
    without a readable record reads the file as at a first start (a changed one is then
    refused by the fingerprint: there is nothing else to go by) and None is returned. A new
    run (no checkpoint) drops a stale record."""
    from ..checkpoint import model_sha256
    from ..errors import ConfigError
    from ..runs.prepare import read_init_file

    path = os.path.join(state_dir, WARM_START_FILE)
    source = config.init_file()
    where = config.path or "<config>"
    if ckpt is None or source is None:
        if ckpt is None and os.path.exists(path):
            os.unlink(path)          # another run's, whose checkpoint was moved away
        return prepare_run(config, **options), None
    try:
        recorded = _read_record(path)
    except StateError as exc:
        if not _holds_model(source):
            raise
        log.warning("%s; model.init's file %s is read again, and the run's fingerprint "
                    "decides", exc, source)
        recorded = None
    if recorded is None:
        try:
            return prepare_run(config, **options), None
        except ConfigError as exc:
            if _holds_model(source):
                raise                 # the file is there: its own error says what is wrong
            # the file is all this checkpoint has to go by: say why, and what would have
            # let it resume (the record a state directory copied in part left behind)
            raise ConfigError(f"{exc}; run {ckpt.run_id}'s checkpoint in {state_dir} has no "
                              f"{WARM_START_FILE} beside it (a run started before edgefl "
                              f"kept one, or a state directory copied without it), so it "
                              f"needs the model it started from to resume") from exc
    if _holds_model(source):
        try:
            now = model_sha256(read_init_file(config).params)
        except ConfigError as exc:
            now = f"unreadable ({exc})"
        if now == recorded["model_sha256"]:
            return prepare_run(config, **options), None
        log.warning("%s: model.init: %s now holds another model (%s) than run %s started "
                    "from (%s, recorded in %s); the run resumes from its checkpoint, which "
                    "holds its model", where, source, now[:12] if len(now) == 64 else now,
                    ckpt.run_id, recorded["model_sha256"][:12], path)
    else:
        log.warning("%s: model.init: %s is gone (no model.npz there); run %s resumes from "
                    "its checkpoint, which holds the model, and checks its fingerprint with "
                    "the parameters' sha256 recorded when it started (%s, %s)", where,
                    source, ckpt.run_id, recorded["model_sha256"][:12], path)
    run = prepare_run(config, read_init=False, **options)
    run.warm_start = recorded
    return run, recorded


def _read_record(path: str) -> dict | None:
    """WARM_START_FILE's record, None when there is none (a run started before it was kept);
    StateError naming the file when it is unreadable or lacks the hash."""
    try:
        record = read_json(path)
    except FileNotFoundError:
        return None
    sha = record.get("model_sha256") if isinstance(record, dict) else None
    if not isinstance(sha, str) or len(sha) != 64:
        raise StateError(f"{path}: not a warm start record (no model_sha256); remove it to "
                         f"read model.init's file again")
    return record


def _holds_model(source: str) -> bool:
    """Whether model.init's path (a run directory or a model.npz) has a model.npz to read
    (a pruned run keeps its directory, without one)."""
    return os.path.exists(os.path.join(source, "model.npz") if os.path.isdir(source)
                          else source)


def run_edge(config: RunConfig, transport, state_dir: str, *, settings, edge_id: str,
             site, client_ids=None, stop=None, stream=None, centre_keys=None) -> bool:
    """`edgefl aggregator --edge ID`: the edge aggregator of one site (roles/edge.py) for the
    run of `config` (the centre's run config), following the centre's rounds through the
    site broker's bridge. `site`: the node ids of the site's clients; `centre_keys`: the
    Verifier of the centre's signed messages, or None. Returns True when the centre finished
    the run, False when stopped first."""
    from .edge import EdgeAggregator

    refuse_over_broker(config)           # before anything is loaded or connected
    _refuse_edges(config)                # and before a strategy's offline phase
    kernel_stop = next((e for e in getattr(stop, "events", [stop])
                        if isinstance(e, StopFlag)), None)
    try:
        # every round's model comes from the centre: model.init's file is the centre's only
        run = prepare_run(config, progress=False, stream=stream or sys.stderr,
                          stop=kernel_stop, read_init=False)
    except TrainingStopped:
        return False
    ids = tuple(client_ids) if client_ids else default_client_ids(len(run.setup.clients))
    if len(ids) != len(run.setup.clients):
        raise ConfigError(f"{config.path or '<config>'}: partition.clients = "
                          f"{len(run.setup.clients)} but {len(ids)} client ids were given")
    plan = RunPlan(run.strategy, run.init_params, run.setup, run.model,
                   config.clients_per_round, ids, description=config.to_dict())
    edge = EdgeAggregator(plan, transport, state_dir, settings, edge_id=edge_id, site=site,
                          stop=stop, centre_keys=centre_keys)
    return edge.run()


def _refuse_edges(config: RunConfig, strategy=None) -> None:
    """A run that cannot go through edge aggregators is refused before anything starts
    (its data, a strategy's offline phase: DUW trains its table), naming why
    (roles.edge.edge_refusal). `strategy`: a checkpoint's, or None: the config's."""
    from .edge import edge_refusal

    if strategy is None:
        strategy = get_strategy(config.strategy, **config.strategy_params)
    why = edge_refusal(strategy, privacy=config.privacy,
                       attack=getattr(config, "attack", None))
    if why is not None:
        raise ConfigError(f"{config.path or '<config>'}: {why}")

