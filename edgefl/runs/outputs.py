"""What a finished run leaves in its output directory, for `edgefl simulate` and
`edgefl aggregator` alike:

    summary.json   final/best accuracy, rounds, the resolved config, model_sha256, bytes
                   moved, timings (run_summary)
    model.npz      the final model (edgefl.checkpoint.save_checkpoint)
    model.onnx     the same model for onnxruntime, with the export extra (export_final_onnx,
                   or a RoundExporter that exported the final round already)
    curves.png     test accuracy and loss by round, with matplotlib (plot_curves)

While the rounds go on, `MetricsLog` writes metrics.jsonl a line per round; it creates the
directory and the file only with the first round's line, so a run that fails before that
leaves the directory as it found it (none, or an earlier run's files under --force).
A `RoundExporter` exports the rounds an ExportPolicy names while the run goes on. A `result`
here is a run's end: `params` (the global model), `history` (one record per round) and
`state` (the server State), as runs.prepare.RunResult has them. Every file is replaced
atomically (edgefl.io).
"""
from __future__ import annotations

import collections
import json
import logging
import os

import numpy as np

from .. import __version__, kernels
from ..checkpoint import model_sha256, save_checkpoint
from ..io import atomic_write, jsonable, write_json
from ..models import Model
from ..runconfig import RunConfig
from ..strategies import Strategy
from .phases import phase

log = logging.getLogger("edgefl.runs.outputs")

__all__ = ["MetricsLog", "RUN_OUTPUTS", "RoundExporter", "absolute_dataset_paths", "dp_summary",
           "export_final_onnx", "plot_curves", "run_summary", "write_outputs"]


# what a run leaves besides metrics.jsonl: an earlier run's, in a directory a run writes into
# (--force), go when that run starts, so the directory never holds two runs' outputs
RUN_OUTPUTS = ("summary.json", "model.npz", "model.onnx", "curves.png")


class MetricsLog:
    """out_dir/metrics.jsonl, one JSON line per round record, flushed as each is written.

    Nothing is created or truncated until `open()`, which the first `write` calls: a run
    that cannot start (a broker that cannot be reached, a transport setting refused once
    the run was prepared, a worker that could not connect) leaves no empty directory
    behind to refuse the corrected command, and with --force does not empty an earlier
    run's metrics.jsonl while that run's summary.json and model.npz stay. A run that did
    start and then stopped or diverged opens it itself (`simulate`), so its directory says
    what it did, even before round 1 ended.
    The one place a run's directory and its metrics.jsonl are opened by `edgefl simulate`
    (the aggregator role rewrites its metrics.jsonl whole after each round: roles.runner)."""

    def __init__(self, out_dir: str | os.PathLike):
        self.out_dir = os.fspath(out_dir)
        self.path = os.path.join(self.out_dir, "metrics.jsonl")
        self._file = None

    def open(self) -> "MetricsLog":
        """Create the directory and start metrics.jsonl afresh (replacing a file there):
        from here the directory is this run's, and an earlier run's RUN_OUTPUTS in it are
        removed (a run that then stops or diverges writes only some of its own, and would
        leave them beside, say, the earlier summary.json; other files, and a directory in
        an output's place, are left). Once only, before the run writes any output (the
        caller's first round export too); later calls do nothing."""
        if self._file is None:
            os.makedirs(self.out_dir, exist_ok=True)
            self._file = open(self.path, "w", encoding="utf-8")
            for name in RUN_OUTPUTS:
                path = os.path.join(self.out_dir, name)
                if os.path.islink(path) or os.path.isfile(path):
                    os.unlink(path)
        return self

    def write(self, record: dict) -> None:
        self.open()
        self._file.write(json.dumps(jsonable(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def write_outputs(out_dir: str, config: RunConfig, model: Model, strategy: Strategy,
                  result, dataset, summary: dict, stream, who: str, *,
                  onnx_exported: bool = False, export=None, onnx: bool = True,
                  plot: bool = True, progress: bool = False) -> None:
    """summary.json, model.npz, model.onnx (with the export extra; unless a RoundExporter
    exported the final round already; `export`, the run's ExportPolicy, says how; not with
    onnx=False) and curves.png (not with plot=False). progress: a line on `stream` for the
    export and the plot, each of which takes a noticeable time (edgefl.runs.phases)."""
    write_json(os.path.join(out_dir, "summary.json"), summary, indent=2)
    save_checkpoint(os.path.join(out_dir, "model.npz"), model, strategy, result, dataset,
                    dataset_config=absolute_dataset_paths(config.dataset, config.path))
    lines = stream if progress else None
    if onnx and not onnx_exported:
        with phase(lines, "export") as note:
            path = os.path.join(out_dir, "model.onnx")
            before = _mtime(path)
            export_final_onnx(out_dir, stream, export, dataset)
            note.append(f"{path}, {os.path.getsize(path):,} bytes"
                        if _mtime(path) != before else "model.onnx not written")
    if plot:
        try:
            with phase(lines, "plot") as note:
                plot_curves(result.history, os.path.join(out_dir, "curves.png"),
                            f"{config.strategy} on {dataset.name}, {config.clients} clients")
                note.append(os.path.join(out_dir, "curves.png"))
        except ImportError as exc:   # matplotlib is an optional extra
            print(f"{who}: curves.png skipped: {exc}", file=stream)


def _mtime(path: str):
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def run_summary(config: RunConfig, model: Model, result, workers: int) -> dict:
    """summary.json's content: accuracy (final and best), the model's hash and size, bytes
    moved, timings (overhead_fraction: the share of wall time outside the parallel phase),
    the backend, the version and the resolved config."""
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
        "model_sha256": model_sha256(result.params),
        "n_params": model.n_params,
        "uplink_bytes": sum(h["uplink_bytes"] for h in result.history),
        "downlink_bytes": sum(h["downlink_bytes"] for h in result.history),
        "wall_s": wall,
        "train_wall_s": train,
        "overhead_fraction": (wall - train) / wall if wall > 0 else 0.0,
        "workers": workers,
        "backend": kernels.backend,
        "backend_reason": kernels.backend_reason,   # why: a fallback says so
        "edgefl_version": __version__,
        "config": config.to_dict(),
        **({"stopped": result.stopped} if getattr(result, "stopped", None) else {}),
        **({"privacy": privacy} if (privacy := dp_summary(config, result)) else {}),
    }


def dp_summary(config: RunConfig, result) -> dict | None:
    """summary.json's account of a DP run: the final (epsilon, delta), how it was accounted,
    the clip (its history when it adapts), and why the run stopped early if it did."""
    dp = config.privacy.dp if config.privacy is not None else None
    if dp is None:
        return None
    from ..privacy.accountant import PrivacyAccountant
    records = [h for h in result.history if "dp_epsilon" in h]
    accountant = PrivacyAccountant(dp, config.clients, config.clients_per_round)
    # the sample is public (the records' `selected`, the announcements, the config's seed):
    # against whoever knows it, a client's epsilon is that of the rounds it was selected in,
    # without amplification by sampling
    selected = collections.Counter(c for h in records for c in h.get("selected", ()))
    most = max(selected.values()) if all("selected" in h for h in records) and selected \
        else len(records)
    out = {"epsilon": records[-1]["dp_epsilon"] if records else 0.0, "delta": dp.delta,
           "mode": dp.mode, "target_epsilon": dp.target_epsilon,
           "rounds_accounted": len(records), **accountant.description,
           "rounds_selected_most": most,
           "epsilon_selection_known": accountant.epsilon_selection_known(most),
           "clip": dp.clip, "reproducible_noise": dp.reproducible}
    if dp.adaptive_clip is not None:
        out["clip_history"] = [h["dp_clip"] for h in records]
        if records:
            out["clip"] = records[-1]["dp_next_clip"]
    if getattr(result, "stopped", None):
        out["stopped"] = result.stopped
    return out


def stopped_summary(config: RunConfig, model: Model, stopped, workers: int) -> dict:
    """summary.json of a run stopped before its last round (errors.RunStopped): run_summary
    of the rounds done (when one was evaluated; else the run's basics and, for a DP run
    with rounds done, its `privacy` block), and `stopped` (errors.stop_record, reason
    "stop_requested"): the round it was in (not recorded), the rounds done and planned.
    `rounds` counts the rounds done."""
    result = stopped.result
    history = result.history if result is not None else []
    if any(h["test_accuracy"] is not None for h in history):
        summary = run_summary(config, model, result, workers)
    else:
        summary = {"rounds": len(history), "n_params": model.n_params, "workers": workers,
                   "backend": kernels.backend, "edgefl_version": __version__,
                   "config": config.to_dict()}
        # rounds done but none evaluated yet (eval_every) still released DP models, and
        # model.npz is written: the privacy they spent is stated all the same (a warm start
        # from that model reads it here)
        if history and (privacy := dp_summary(config, result)):
            summary["privacy"] = privacy
    summary["stopped"] = stopped.record
    return summary


def absolute_dataset_paths(dataset_section, config_path) -> dict:
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
    dataset (normalisation, class names; the test set gives the accuracy in the metadata) of
    `run`, the PreparedRun (roles.runner) being run. Called as on_model(round, params);
    returns the path when it exported. Without the `onnx` package (the export extra) it says
    so once and exports nothing; an export that fails is reported and the run goes on (its
    state is not at stake)."""

    def __init__(self, run, out_dir: str, policy, stream, who: str, *, lines=None,
                 before_line=None, defer_final: bool = False):
        """lines: a stream for the progress line of the final round's export (none: no
        line); before_line(): called first, to end a progress bar drawn on that line.
        defer_final: the final round is not exported when its model comes (on_model) but
        when the caller calls `finish` (edgefl simulate: after it let the training set go)."""
        from ..export import ExportPolicy

        self.run = run
        self.path = os.path.join(os.fspath(out_dir), "model.onnx")
        self.policy = policy if policy is not None else ExportPolicy()
        self.stream = stream
        self.who = who
        self.exported: list = []             # [{round, bytes, accuracy}] of this process
        self.last_round: int | None = None
        self._unavailable = False
        self.lines, self.before_line = lines, before_line
        self.defer_final = defer_final

    def __call__(self, round: int, params) -> str | None:
        if self.defer_final and round == self.run.config.rounds:
            return None
        return self.finish(round, params)

    def finish(self, round: int, params) -> str | None:
        """Export round `round`'s model if the policy names it (the final round's with its
        progress line): what on_model does, and the deferred final export."""
        if self.lines is None or round != self.run.config.rounds or \
                not self.policy.due(round, self.run.config.rounds):
            return self._export(round, params)
        if self.before_line is not None:
            self.before_line()
        with phase(self.lines, "export") as note:
            path = self._export(round, params)
            note.append(f"{path}, {self.exported[-1]['bytes']:,} bytes" if path else
                        "model.onnx not written")
        return path

    def _export(self, round: int, params) -> str | None:
        if self._unavailable or not self.policy.due(round, self.run.config.rounds):
            return None
        try:
            from ..export import ExportError, export_run, run_from_params
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
                                   dataset_config=absolute_dataset_paths(config.dataset,
                                                                         config.path))
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


def export_final_onnx(out_dir: str, stream, policy=None, dataset=None) -> None:
    """model.onnx next to model.npz (atomic replace), when the optional onnx extra is present.

    Called by write_outputs after summary.json and model.npz are written, when no
    RoundExporter exported the final round (it failed, or the run had none). Like a
    RoundExporter's, a failed export is logged with its cause and the run goes on: the
    trained model is safe in model.npz, the rest of the outputs (curves.png) still get
    written, and `edgefl export <out_dir>` can retry. A model.onnx already there (an earlier
    round's export) is left as it was, and the message says so. `policy` (the run's
    ExportPolicy) gives the softmax output and quantisation, as the RoundExporter's would;
    `dataset`, the run's, measures the accuracy without loading the data set a second time."""
    path = os.path.join(out_dir, "model.onnx")
    try:
        from ..export import export_checkpoint
        if policy is None:
            export_checkpoint(out_dir, path, dataset=dataset)
        else:
            export_checkpoint(out_dir, path, softmax=policy.softmax,
                              quantize=None if policy.quantize == "none" else "int8",
                              dataset=dataset)
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


def plot_curves(history: list, path: str, title: str = ""):
    """curves.png: test accuracy (left) and test/train loss (right) by round; matplotlib's
    Agg canvas directly, no pyplot state. Returns the Figure written. Rounds are whole
    numbers, so the round axes tick at integers only (a 3-round run would otherwise show
    1.25, 1.5, ...)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
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
    for axes in (acc, loss):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100))
    return fig
