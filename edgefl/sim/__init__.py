"""`edgefl simulate`: a whole federation, the aggregator and N virtual clients, in one
process, for trying an algorithm or a config on one machine before a fleet runs it.

    loop.py         run_federation: the round engine's rounds over in-memory clients, trained
                    in a thread pool
    asynchronous.py run_asynchronous: buffered asynchronous steps (FedBuff) on the virtual
                    clock, the engine's asynchronous caller
    clock.py        the virtual clock: each task's simulated seconds on the `sim_fleet:`, the
                    event queue
    over_broker.py  run_over_broker: the same rounds through an MQTT broker with the real
                    roles, the clients in worker processes (`--transport mqtt`)
    hosting.py      many client roles driven by one thread; a worker process's body
    progress.py     the progress bar
    secure.py       the secure rounds in process (real SecAgg+ between the in-process clients)

`simulate` (here) runs either for a RunConfig: it prepares the run as `edgefl aggregator`
does (edgefl.runs.prepare: data set, partition, model, strategy) and writes to an output
directory (metrics.jsonl as the rounds end, the rest by edgefl.runs.outputs):

    metrics.jsonl  one JSON object per round, the round engine's record (edgefl/rounds.py
                   lists its keys), written as each round ends
    summary.json   final/best accuracy, rounds, the resolved config, model_sha256 (of the
                   final global float32 buffer), bytes moved, timings (overhead_fraction =
                   share of wall time outside the parallel phase)
    model.npz      the final global buffer, layer table (JSON), model spec, round, the
                   strategy's state buffers and meta, the input normalisation
    curves.png     test accuracy and loss by round
"""
from __future__ import annotations

import os
import sys
from typing import Mapping

from ..checkpoint import save_checkpoint
from ..data.layout import without_training_rows
from ..errors import NonFiniteError, RunStopped, TrainingStopped
from ..export import CALIBRATION_SAMPLES
from ..io import write_json
from ..privacy import PrivacyHooks
from ..runconfig import RunConfig
from ..runs.outputs import (MetricsLog, RoundExporter, absolute_dataset_paths,
                            run_summary, stopped_summary, write_outputs)
from ..runs.prepare import prepare_run
from ..virtual_fleet import refuse_over_broker
from .asynchronous import run_asynchronous
from .clock import Clock
from .loop import run_federation
from .over_broker import check_options, reach_broker, run_over_broker
from .progress import Progress

__all__ = ["TRANSPORTS", "simulate", "run_federation", "run_asynchronous", "run_over_broker",
           "Progress", "Clock"]


TRANSPORTS = ("inproc", "mqtt")


def simulate(config: RunConfig, out_dir: str | os.PathLike | None, *, workers: int | None = None,
             progress: bool | None = None, stream=None, transport: str = "inproc",
             broker: str | None = None, broker_kind: str = "auto",
             mqtt: Mapping | None = None, export=None, stop=None, onnx: bool = True,
             plot: bool = True) -> dict:
    """Run the configured federation and write metrics.jsonl, summary.json, model.npz and
    curves.png into `out_dir` (None: write nothing). progress: None = show a progress bar on
    stderr (a bar on a TTY, one line per round otherwise), False = silent. Returns the
    summary dict.

    transport "inproc" (default) runs `run_federation`; "mqtt" runs the same rounds through
    a broker -- `broker` (a URL), or an EmbeddedBroker of `broker_kind` started for the run --
    with the aggregator in this process and one client per partition shard, each with its
    own connection, hosted by worker processes (`run_over_broker`; `mqtt`: its keyword
    options). Both give the same final model.

    export: an edgefl.export.ExportPolicy; out_dir/model.onnx is the final model, replaced
    atomically after every `export.every`-th round too (None: the final model only).

    stop: a kernels.StopFlag (edgefl.service.signals' StopSignal in `edgefl simulate`). Once
    it is set, every local round stops before its next step and RunStopped is raised; by
    then out_dir holds the rounds done: metrics.jsonl (whole lines), summary.json with a
    `stopped` entry, and model.npz of the last round done (none if no round was done); no
    ONNX export or plot, and runs/NAME is not pointed at it.

    onnx=False: no model.onnx at all; plot=False: no curves.png (`--no-export`,
    `--no-plot`). With progress shown, loading the data, the export and the plot each say
    what they did and how long it took (edgefl.runs.phases)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport {transport!r}; valid: {', '.join(TRANSPORTS)}")
    if transport == "inproc" and broker is not None:
        raise ValueError("a broker URL needs transport 'mqtt'")
    # privacy: in process (_privacy_rounds) and over a broker alike: the central-DP
    # aggregator clips what it receives, and under secure aggregation the boards clip and
    # add their noise shares (roles.aggregator, roles.client)
    if transport != "inproc":
        refuse_over_broker(config)
        # the transport's settings are refused before the data is loaded (and, as for
        # anything that fails before round 1, before out_dir is touched: MetricsLog)
        check_options(broker, **dict(mqtt or {}))
        if broker is not None:
            # and the user's broker is reached before the run is prepared: a strategy's
            # offline phase (DUW's) would otherwise run first, and write into out_dir
            reach_broker(broker, f"edgefl-sim-probe-{os.getpid()}",
                         float(dict(mqtt or {}).get("connect_timeout", 30.0)))
    try:
        run = prepare_run(config, workers=workers, out_dir=out_dir, progress=progress,
                          stream=stream, stop=stop)
    except TrainingStopped:             # in a strategy's offline phase (DUW's)
        raise RunStopped(1, None, config.rounds) from None
    asynchronous = getattr(run.strategy, "asynchronous", False)
    dataset, model, strategy = run.dataset, run.model, run.strategy
    init_params, clients, setup = run.init_params, run.clients, run.setup
    workers = (os.cpu_count() or 1) if workers is None else int(workers)

    # out_dir and its metrics.jsonl are created with the first round's record, not here: a
    # run over a broker can still fail before round 1 (no broker, a worker's clients that
    # cannot connect), and must leave out_dir as it found it
    metrics = None
    if out_dir is not None:
        out_dir = os.fspath(out_dir)
        metrics = MetricsLog(out_dir)
    bar = Progress(config.rounds, stream or sys.stderr, enabled=progress is not False)
    exporter = RoundExporter(run, out_dir, export, stream or sys.stderr, "edgefl simulate",
                             lines=bar.stream if bar.enabled else None,
                             before_line=bar.close, defer_final=True) \
        if out_dir is not None and onnx else None

    def on_round(record):
        if metrics is not None:
            metrics.write(record)
        bar.update(record)

    def export_round(r, params):
        if exporter is None:
            return None
        # a round's export can come before the first record (deferred evaluation): the
        # directory becomes this run's first, so MetricsLog.open never removes it
        metrics.open()
        return exporter(r, params)

    broker_info = None
    clock = None if config.fleet is None else \
        Clock.for_fleet(config.fleet, setup.clients, config.seed, model.n_params)
    try:
        if asynchronous and transport == "inproc":
            result = run_asynchronous(strategy, init_params, clients, setup,
                                      config.clients_per_round, clock=clock,
                                      test=(dataset.x_test, dataset.y_test),
                                      eval_every=config.eval_every, workers=workers,
                                      on_round=on_round, on_model=export_round, stop=stop)
        elif transport == "inproc":
            result = run_federation(strategy, init_params, clients, setup,
                                    config.clients_per_round,
                                    test=(dataset.x_test, dataset.y_test),
                                    eval_every=config.eval_every, workers=workers,
                                    on_round=on_round, on_model=export_round, clock=clock,
                                    stop=stop, **_privacy_rounds(config, run.hooks))
        else:
            result, broker_info = run_over_broker(run, broker, broker_kind=broker_kind,
                                                  workers=workers, on_round=on_round,
                                                  on_model=export_round, stop=stop,
                                                  **dict(mqtt or {}))
    except RunStopped as stopped:
        stopped.summary = stopped_summary(config, model, stopped, workers)
        if out_dir is not None:
            metrics.open()        # (stopped before round 1: an empty one, as summary says)
            write_json(os.path.join(out_dir, "summary.json"), stopped.summary, indent=2)
            if stopped.result is not None and stopped.result.history:
                save_checkpoint(os.path.join(out_dir, "model.npz"), model, strategy,
                                stopped.result, dataset,
                                dataset_config=absolute_dataset_paths(config.dataset,
                                                                      config.path))
        raise
    except NonFiniteError:
        # the run had started (whatever could refuse it had passed): out_dir is this run's
        # and holds the rounds before the one that diverged, none if it was round 1
        if metrics is not None:
            metrics.open()
        raise
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()

    summary = run_summary(config, model, result, workers)     # (with a DP budget's stop)
    if run.warm_start is not None:
        summary["init"] = run.warm_start
    if out_dir is not None:
        # The rounds are over: let the training set go before the export and the plot load
        # their libraries (onnxruntime, matplotlib: ~100 MB), so the run's peak memory is its
        # rounds', not the rounds' plus the outputs'. What the outputs read stays: the test
        # set, the normalisation, the first training samples (an int8 export's calibration).
        dataset = run.dataset = without_training_rows(dataset, CALIBRATION_SAMPLES)
        run.clients = clients = None
        if exporter is not None and result.history[-1]["round"] == config.rounds:
            exporter.finish(config.rounds, result.params)     # (deferred to here)
    if "sim_time_s" in result.history[-1]:
        summary["sim_time_s"] = result.history[-1]["sim_time_s"]
    if clock is not None:
        summary["fleet"] = clock.describe()
    if broker_info is not None:
        summary["transport"] = broker_info
    if exporter is not None and exporter.exported:
        summary["onnx_exports"] = list(exporter.exported)
    if out_dir is not None:
        write_outputs(out_dir, config, model, strategy, result, dataset, summary,
                      stream or sys.stderr, "edgefl simulate",
                      onnx_exported=exporter is not None and exporter.last_round == config.rounds,
                      export=exporter.policy if exporter is not None else None, onnx=onnx,
                      plot=plot, progress=progress is not False)
    return summary


def _privacy_rounds(config: RunConfig, hooks: PrivacyHooks) -> dict:
    """run_federation's keyword arguments for the config's `privacy:` section: summing
    rounds, DP's hooks (the run's, from prepare_run), and the secure sum when secure
    aggregation is asked for."""
    privacy = config.privacy
    if privacy is None:
        return {}
    out: dict = {"summing": True, "hooks": hooks}
    if privacy.secure_aggregation is not None:
        # (imported here: secure aggregation's modules and cryptography cost every other
        # run ~20 ms of start-up)
        from .secure import in_process_secure_sum
        run_id = f"{os.path.basename(config.path or 'run')}:{config.seed}"
        out["secure_sum"] = in_process_secure_sum(privacy.secure_aggregation, run_id,
                                                  config.seed)
    return out
