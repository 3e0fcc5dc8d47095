"""`edgefl compare DIR...`: put finished `edgefl simulate` runs side by side (issue #3 item 5).

Each DIR is a run directory (summary.json + metrics.jsonl, as `edgefl.sim.simulate` writes
them). `compare_table` gives one Markdown row per run

    run | strategy | dataset | partition | final acc | best acc (round) | rounds to >= ACC |
    up+down bytes | wall

where "rounds to >= ACC" is the first round whose test accuracy reached ACC ("*" when no
evaluated round did) -- followed, when a run has a virtual clock (`sim_fleet:`, FedBuff), by
"sim s to >= ACC", the simulated seconds of that round ("–" for a run without a clock) -- bytes are the float32 model bytes the run moved (uplink plus downlink
summed over rounds, binary units), and wall is the round loop's wall time from summary.json,
plus, shown separately, an offline phase that ran before round 1 (DUW's weight training,
whose time duw_weights.json in the run directory records). `overlay_figure` draws test
accuracy and test loss by round, one line per run.

A field of summary.json or metrics.jsonl that a row reads and that is not of its type (an
accuracy "abc") is refused naming the file (and line) and the field; an absent or null one
is unknown ("–"), as in a run stopped before any evaluated round.

The functions here are also what `tools/reproduce.py` builds its tables from.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from .io import atomic_write

__all__ = [
    "Run",
    "RunDirError",
    "check_target",
    "comparison_rows",
    "describe_section",
    "format_bytes",
    "format_duration",
    "load_run",
    "load_runs",
    "markdown_table",
    "overlay_figure",
    "plot_overlay",
    "read_history",
    "rounds_to_target",
    "strategy_label",
]


class RunDirError(ValueError):
    """A directory that is not a finished run; the message names it and what is missing."""


@dataclass(frozen=True)
class Run:
    """One finished run: its directory, display name, summary.json and metrics.jsonl rows."""
    path: str
    name: str
    summary: dict
    history: list = field(repr=False)
    offline_s: float | None = None    # an offline phase before round 1 (DUW weight training)

    @property
    def config(self) -> dict:
        return self.summary.get("config") or {}

    @property
    def bytes_moved(self) -> int | None:
        """Uplink plus downlink bytes, or None when the summary lacks either (a run stopped
        before its byte counts were written): unknown, not 0 B."""
        up, down = self.summary.get("uplink_bytes"), self.summary.get("downlink_bytes")
        return None if up is None or down is None else int(up) + int(down)

    @property
    def evaluated(self) -> list:
        """(round, accuracy, loss) of every evaluated round, in order."""
        return [(h["round"], h["test_accuracy"], h.get("test_loss")) for h in self.history
                if h.get("test_accuracy") is not None]

    def rounds_to(self, target: float) -> int | None:
        return rounds_to_target(self.history, target)


def _read_summary(path: str) -> dict:
    summary_path = os.path.join(path, "summary.json")
    if not os.path.isfile(summary_path):
        hint = (" (metrics.jsonl is there: the run did not finish, or is still running)"
                if os.path.isfile(os.path.join(path, "metrics.jsonl")) else "")
        raise RunDirError(f"{path}: no summary.json, so it is not a finished `edgefl simulate` "
                          f"run directory{hint}")
    try:
        with open(summary_path, encoding="utf-8") as f:
            summary = json.load(f)
    except json.JSONDecodeError as exc:
        raise RunDirError(f"{summary_path}: not valid JSON (line {exc.lineno}: {exc.msg})") \
            from None
    if not isinstance(summary, dict):
        raise RunDirError(f"{summary_path}: expected a JSON object, got {type(summary).__name__}")
    for key in ("config", "rounds"):
        if summary.get(key) is None:
            raise RunDirError(f"{summary_path}: no {key} (the run's {_REQUIRED[key]}, which "
                              f"every summary.json of `edgefl simulate` holds)")
    _check_fields(summary, _SUMMARY_FIELDS, summary_path)
    _check_fields(summary["config"], _CONFIG_FIELDS, summary_path, "config.")
    return summary


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_NUMBER = (_is_number, "a number")
_COUNT = (_is_count, "a whole number >= 0")
_SECONDS = (lambda v: _is_number(v) and v >= 0, "a number >= 0")
_OBJECT = (lambda v: isinstance(v, dict), "an object")

# What a table row reads, and its type. A field may be absent or null: a run stopped before
# any evaluated round has no accuracy, bytes or wall time (runs.outputs.stopped_summary), and
# the row shows "–". config and rounds every summary has, a stopped run's too.
_REQUIRED = {"config": "configuration", "rounds": "number of rounds done"}
_SUMMARY_FIELDS = {"config": _OBJECT, "rounds": _COUNT, "final_accuracy": _NUMBER,
                   "best_accuracy": _NUMBER, "best_round": _COUNT, "uplink_bytes": _COUNT,
                   "downlink_bytes": _COUNT, "wall_s": _SECONDS}
_CONFIG_FIELDS = {"strategy": _OBJECT, "dataset": _OBJECT, "partition": _OBJECT}
_METRICS_FIELDS = {"round": _COUNT, "test_accuracy": _NUMBER, "test_loss": _NUMBER,
                   "sim_time_s": _SECONDS}


def _check_fields(record: dict, fields: dict, where: str, prefix: str = "") -> None:
    """RunDirError naming `where` and the field when one of `fields` is present, not null,
    and not of its type (a string "abc" for an accuracy)."""
    for key, (valid, what) in fields.items():
        value = record.get(key)
        if value is not None and not valid(value):
            raise RunDirError(f"{where}: {prefix}{key} must be {what}, got {value!r}")


def read_history(path: str) -> list:
    """The round records of run directory `path` (its metrics.jsonl), also of a run that
    never wrote summary.json; RunDirError names the file and line of anything unreadable."""
    metrics_path = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(metrics_path):
        raise RunDirError(f"{path}: has summary.json but no metrics.jsonl (the per-round "
                          f"metrics `edgefl simulate` writes)")
    history = []
    with open(metrics_path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RunDirError(f"{metrics_path}, line {number}: not valid JSON ({exc.msg})") \
                    from None
            if not isinstance(record, dict) or record.get("round") is None:
                raise RunDirError(f"{metrics_path}, line {number}: expected an object with a "
                                  f"'round' key")
            _check_fields(record, _METRICS_FIELDS, f"{metrics_path}, line {number}")
            history.append(record)
    if not history:
        raise RunDirError(f"{metrics_path}: no rounds recorded")
    return history


def load_run(path: str | os.PathLike, name: str | None = None) -> Run:
    """Read a run directory; RunDirError names the directory and what is wrong with it."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise RunDirError(f"{path}: no such directory")
    if not os.path.isdir(path):
        raise RunDirError(f"{path}: not a directory (give the run directory that holds "
                          f"summary.json and metrics.jsonl)")
    summary = _read_summary(path)
    history = read_history(path)
    # Every summary.json counts the rounds of its metrics.jsonl (run_summary, stopped_summary).
    # They differ when a later run took the directory over (--force) and is still going, was
    # killed or diverged: its metrics.jsonl is new, the summary the earlier run's, and a row
    # of the two would show one run's accuracy beside the other's curve.
    if summary["rounds"] != len(history):
        raise RunDirError(
            f"{path}: summary.json counts {summary['rounds']} rounds but metrics.jsonl holds "
            f"{len(history)}: they are not one run's (a run still running, or killed or "
            f"diverged, in a directory whose earlier run left its summary.json)")
    return Run(path, name or os.path.basename(os.path.normpath(path)) or path, summary, history,
               _offline_seconds(path))


def _offline_seconds(path: str) -> float | None:
    """The wall time of DUW's weight training when this run did it (it then leaves
    duw_weights.json beside summary.json); None otherwise."""
    weights_path = os.path.join(path, "duw_weights.json")
    if not os.path.isfile(weights_path):
        return None
    try:
        with open(weights_path, encoding="utf-8") as f:
            seconds = json.load(f).get("wall_s")
    except (json.JSONDecodeError, AttributeError):
        raise RunDirError(f"{weights_path}: not a DUW weight file (invalid JSON object)") \
            from None
    return float(seconds) if isinstance(seconds, (int, float)) else None


def load_runs(paths: Sequence[str | os.PathLike]) -> list:
    """Runs named by the shortest trailing path that tells them apart
    (a/seed0 and b/seed0 become "a/seed0" and "b/seed0", not "seed0" twice)."""
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise RunDirError("no run directories given")
    parts = [os.path.normpath(os.path.abspath(p)).split(os.sep) for p in paths]
    depth = 1
    while depth < max(len(p) for p in parts):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            break
        depth += 1
    names = ["/".join(p[-depth:]) for p in parts]
    return [load_run(p, n) for p, n in zip(paths, names)]


def rounds_to_target(history: Sequence[dict], target: float) -> int | None:
    """The first round whose test accuracy is >= target, or None if no evaluated round is."""
    for record in history:
        acc = record.get("test_accuracy")
        if acc is not None and acc >= target:
            return int(record["round"])
    return None


def sim_time_to_target(history: Sequence[dict], target: float) -> float | None:
    """The simulated time (sim_time_s) of the first record whose test accuracy is >= target,
    or None when none is or the run had no virtual clock."""
    r = rounds_to_target(history, target)
    record = next((h for h in history if h["round"] == r), None) if r is not None else None
    return None if record is None else record.get("sim_time_s")


def check_target(target: float) -> float:
    """A target accuracy must be a fraction in (0, 1]."""
    if isinstance(target, bool) or not isinstance(target, (int, float)) \
            or not math.isfinite(target) or not 0 < target <= 1:
        hint = f"; did you mean {target / 100:g}?" if isinstance(target, (int, float)) \
            and 1 < target <= 100 else ""
        raise ValueError(f"target accuracy {target!r} must be a fraction in (0, 1]{hint}")
    return float(target)


def format_bytes(n: float) -> str:
    """Binary units, three significant digits: 512 B, 1.50 KiB, 23.4 MiB, 1.20 GiB."""
    n = float(n)
    if n < 1024:
        return f"{int(n)} B"
    unit = "B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024.0
        if n < 1024:
            break
    return f"{n:.2f} {unit}" if n < 10 else f"{n:.1f} {unit}"


def format_duration(seconds: float) -> str:
    """0.42 s, 12.3 s, 3m05s, 1h02m."""
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(round(seconds), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def _short(value) -> str:
    """A config value for a table cell: long lists are summarised by their length."""
    if isinstance(value, (list, tuple)):
        if len(value) > 8:
            return f"[{len(value)} values]"
        return "[" + ",".join(_short(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def describe_section(section: dict | None, skip=("name", "path", "test_path")) -> str:
    """"name(k=v, ...)" for a dataset or partition section."""
    if not section:
        return "?"
    options = ", ".join(f"{k}={_short(v)}" for k, v in section.items()
                        if k not in skip and v is not None)
    return f"{section.get('name', '?')}({options})" if options else str(section.get("name", "?"))


def strategy_label(strategy: dict | None, show=()) -> str:
    """The strategy's name, the parameters that differ from its defaults and those named in
    `show` ("mfl gamma=0.9"); all parameters when the defaults cannot be looked up."""
    if not strategy:
        return "?"
    name = strategy.get("name", "?")
    try:
        from .strategies import strategy_params
        defaults = strategy_params(name)
    except ValueError:
        defaults = {}

    def is_default(key, value):
        if key not in defaults:
            return False
        default = defaults[key]
        return default == value or (isinstance(default, tuple) and list(default) == value)

    shown = [f"{k}={_short(v)}" for k, v in strategy.items()
             if k != "name" and v is not None and (k in show or not is_default(k, v))]
    return " ".join([name, *shown])


def _varying_parameters(runs: Sequence[Run]) -> dict:
    """{strategy name: parameters whose values differ among the runs of that strategy}, so
    a sweep over a default value still labels every run (gamma=0.5 next to gamma=0.9)."""
    seen: dict = {}
    for run in runs:
        strategy = run.config.get("strategy") or {}
        for key, value in strategy.items():
            seen.setdefault(strategy.get("name"), {}).setdefault(key, set()).add(
                json.dumps(value, sort_keys=True))
    return {name: {k for k, values in params.items() if len(values) > 1}
            for name, params in seen.items()}


def comparison_rows(runs: Sequence[Run], target: float | None = None) -> list:
    """One dict per run with the table's values (numbers unformatted, None when unknown)."""
    rows = []
    varying = _varying_parameters(runs)
    for run in runs:
        s, cfg = run.summary, run.config
        strategy = cfg.get("strategy") or {}
        rows.append({
            "run": run.name,
            "path": run.path,
            "strategy": strategy_label(strategy, varying.get(strategy.get("name"), ())),
            "dataset": describe_section(cfg.get("dataset")),
            "partition": describe_section(cfg.get("partition")),
            "rounds": s.get("rounds", len(run.history)),
            "final_accuracy": s.get("final_accuracy"),
            "best_accuracy": s.get("best_accuracy"),
            "best_round": s.get("best_round"),
            "target": target,
            "rounds_to_target": run.rounds_to(target) if target is not None else None,
            "clocked": "sim_time_s" in run.history[-1],
            "sim_s_to_target": sim_time_to_target(run.history, target)
            if target is not None else None,
            "uplink_bytes": s.get("uplink_bytes"),
            "downlink_bytes": s.get("downlink_bytes"),
            "bytes": run.bytes_moved,
            "wall_s": s.get("wall_s"),
            "offline_s": run.offline_s,
        })
    return rows


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _acc(x) -> str:
    return "–" if x is None else f"{x:.4f}"


def markdown_table(rows: Sequence[dict], target: float | None = None) -> str:
    """The Markdown table of `comparison_rows`; the rounds-to-target column only when a
    target was given."""
    header = ["run", "strategy", "dataset", "partition", "final acc", "best acc (round)"]
    clocked = target is not None and any(row.get("clocked") for row in rows)
    if target is not None:
        header.append(f"rounds to ≥{target:g}")
    if clocked:
        header.append(f"sim s to ≥{target:g}")
    header += ["up+down bytes", "wall"]
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i < 4 else "--:" for i in range(len(header))) + "|"]
    for row in rows:
        best = "–" if row["best_accuracy"] is None else \
            f"{row['best_accuracy']:.4f} ({row['best_round']})"
        cells = [row["run"], row["strategy"], row["dataset"], row["partition"],
                 _acc(row["final_accuracy"]), best]
        if target is not None:
            r = row["rounds_to_target"]
            cells.append("*" if r is None else str(r))
        if clocked:
            t = row["sim_s_to_target"]
            cells.append("–" if not row["clocked"] else "*" if t is None else f"{t:.3g}")
        wall = "–" if row["wall_s"] is None else format_duration(row["wall_s"])
        if row.get("offline_s") is not None:
            wall += f" (+{format_duration(row['offline_s'])} offline)"
        cells += ["–" if row["bytes"] is None else format_bytes(row["bytes"]), wall]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    if target is not None:
        lines.append("")
        lines.append(f"\\* = test accuracy {target:g} not reached within the run's rounds.")
    return "\n".join(lines)


def overlay_figure(runs: Sequence[Run], target: float | None = None, title: str = ""):
    """A matplotlib Figure (Agg canvas, no pyplot state): test accuracy by round (left) and
    test loss by round (right), one line per run, the same colour for a run in both panels;
    a dashed line at the target accuracy when given."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("the overlay plot needs matplotlib (pip install 'edgefl[plot]')") \
            from exc
    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    acc_ax, loss_ax = fig.subplots(1, 2)
    for i, run in enumerate(runs):
        points = run.evaluated
        color = f"C{i % 10}"
        rounds = [p[0] for p in points]
        acc_ax.plot(rounds, [p[1] for p in points], color=color, label=run.name)
        losses = [(r, loss) for r, _, loss in points if loss is not None and math.isfinite(loss)]
        loss_ax.plot([r for r, _ in losses], [loss for _, loss in losses], color=color,
                     label=run.name)
    if target is not None:
        acc_ax.axhline(target, color="0.4", linestyle="--", linewidth=1,
                       label=f"target {target:g}")
    acc_ax.set_xlabel("round")
    acc_ax.set_ylabel("test accuracy")
    loss_ax.set_xlabel("round")
    loss_ax.set_ylabel("test loss")
    for ax in (acc_ax, loss_ax):
        ax.grid(True, alpha=0.3)
    acc_ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_overlay(runs: Sequence[Run], path: str | os.PathLike, target: float | None = None,
                 title: str = "") -> None:
    """Write `overlay_figure` to a PNG, atomically (edgefl.io.atomic_write)."""
    path = os.fspath(path)
    fig = overlay_figure(runs, target, title)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100))
