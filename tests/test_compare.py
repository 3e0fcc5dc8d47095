"""`edgefl compare`: the table and JSON agree with the runs' own files, the overlay plot has
one line per run, and directories that are not finished runs get errors naming them.
The runs are real `simulate` runs on digits (a few rounds, well under a second each)."""
import json
import os
import shutil

import pytest

from edgefl.cli import main
from edgefl.compare import (
    format_bytes,
    format_duration,
    load_run,
    load_runs,
    overlay_figure,
    rounds_to_target,
)
from edgefl.runconfig import run_config_from_mapping
from edgefl.sim import simulate

BASE = {
    "dataset": {"name": "digits", "limit_train": 600},
    "partition": {"name": "iid", "clients": 4},
    "model": {"name": "softmax"},
    "train": {"lr": 0.05, "batch_size": 32, "steps": 4},
    "rounds": 6,
    "seed": 0,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two finished runs: FedAvg and MFL (twice FedAvg's bytes: MFL paper §7.2.5)."""
    root = tmp_path_factory.mktemp("runs")
    dirs = {}
    for name, strategy in [("fedavg", {"name": "fedavg"}), ("mfl", {"name": "mfl", "gamma": 0.5})]:
        config = run_config_from_mapping(dict(BASE, strategy=strategy))
        dirs[name] = str(root / name)
        simulate(config, dirs[name], workers=1, progress=False)
    return dirs


def read_files(path):
    with open(os.path.join(path, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(path, "metrics.jsonl")) as f:
        history = [json.loads(line) for line in f]
    return summary, history


def first_round_at(history, target):
    """Independent of edgefl.compare: the first evaluated round with accuracy >= target."""
    hits = [h["round"] for h in history
            if h["test_accuracy"] is not None and h["test_accuracy"] >= target]
    return hits[0] if hits else None


def table_rows(text):
    """{run: {column: cell}} of the Markdown table in `text`."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def test_markdown_table_reports_each_runs_numbers(runs, tmp_path, capsys):
    target = 0.5
    png = tmp_path / "overlay.png"
    assert main(["compare", runs["fedavg"], runs["mfl"], "--target", str(target),
                 "--out", str(png)]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert set(rows) == {"fedavg", "mfl"}
    for name, path in runs.items():
        _, history = read_files(path)
        row = rows[name]
        assert row["strategy"].split()[0] == name
        assert row["dataset"].startswith("digits") and row["partition"].startswith("iid")
        assert row["final acc"] == f"{history[-1]['test_accuracy']:.4f}"
        best = max(h["test_accuracy"] for h in history)
        best_round = next(h["round"] for h in history if h["test_accuracy"] == best)
        assert row["best acc (round)"] == f"{best:.4f} ({best_round})"
        reached = first_round_at(history, target)
        assert row[f"rounds to ≥{target:g}"] == (str(reached) if reached else "*")
        moved = sum(h["uplink_bytes"] + h["downlink_bytes"] for h in history)
        assert row["up+down bytes"] == format_bytes(moved)
    assert rows["fedavg"]["strategy"] == "fedavg"
    # MFL sends model and momentum both ways: exactly twice FedAvg's bytes.
    assert read_files(runs["mfl"])[0]["uplink_bytes"] == 2 * read_files(runs["fedavg"])[0]["uplink_bytes"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unreached_target_is_a_star(runs, tmp_path, capsys):
    summary, history = read_files(runs["fedavg"])
    target = summary["best_accuracy"] + 1e-6
    assert target <= 1.0, "the fixture run reached 100% accuracy; pick a harder setting"
    assert main(["compare", runs["fedavg"], "--target", repr(target),
                 "--out", str(tmp_path / "p.png")]) == 0
    row = table_rows(capsys.readouterr().out)["fedavg"]
    assert row[f"rounds to ≥{target:g}"] == "*"
    assert rounds_to_target(history, target) is None
    assert rounds_to_target(history, summary["best_accuracy"]) == summary["best_round"]


def test_without_target_there_is_no_rounds_column(runs, tmp_path, capsys):
    assert main(["compare", runs["fedavg"], "--out", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "rounds to" not in out and "| fedavg |" in out


def test_json_rows_equal_the_summaries(runs, tmp_path, capsys):
    assert main(["compare", runs["fedavg"], runs["mfl"], "--target", "0.6", "--json",
                 "--out", str(tmp_path / "p.png")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["target"] == 0.6 and [r["run"] for r in doc["runs"]] == ["fedavg", "mfl"]
    for row in doc["runs"]:
        summary, history = read_files(runs[row["run"]])
        assert row["final_accuracy"] == summary["final_accuracy"]
        assert row["best_accuracy"] == summary["best_accuracy"]
        assert row["best_round"] == summary["best_round"]
        assert row["bytes"] == summary["uplink_bytes"] + summary["downlink_bytes"]
        assert row["wall_s"] == summary["wall_s"]
        assert row["rounds_to_target"] == first_round_at(history, 0.6)
        assert row["offline_s"] is None


def test_overlay_has_one_line_per_run_with_its_curve(runs):
    loaded = load_runs([runs["fedavg"], runs["mfl"]])
    fig = overlay_figure(loaded, target=0.7)
    acc_ax, loss_ax = fig.axes
    curves = [line for line in acc_ax.get_lines() if line.get_label() in ("fedavg", "mfl")]
    assert [line.get_label() for line in curves] == ["fedavg", "mfl"]
    assert len(loss_ax.get_lines()) == 2
    for line in curves:
        _, history = read_files(runs[line.get_label()])
        assert list(line.get_xdata()) == [h["round"] for h in history]
        assert list(line.get_ydata()) == [h["test_accuracy"] for h in history]
    targets = [line for line in acc_ax.get_lines() if line.get_label() == "target 0.7"]
    assert len(targets) == 1 and list(targets[0].get_ydata()) == [0.7, 0.7]


def test_strategy_labels_show_what_differs(runs, tmp_path, capsys):
    """Defaults are left out, except a parameter that varies among the compared runs:
    a gamma sweep that includes MFL's default 0.5 still labels that run."""
    other = tmp_path / "mfl09"
    config = run_config_from_mapping(dict(BASE, strategy={"name": "mfl", "gamma": 0.9}, rounds=2))
    simulate(config, str(other), workers=1, progress=False)
    assert main(["compare", runs["mfl"], str(other), runs["fedavg"],
                 "--out", str(tmp_path / "p.png")]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert rows["mfl"]["strategy"] == "mfl gamma=0.5"
    assert rows["mfl09"]["strategy"] == "mfl gamma=0.9"
    assert rows["fedavg"]["strategy"] == "fedavg"


def test_runs_with_the_same_basename_get_distinct_names(runs, tmp_path):
    for group in ("a", "b"):
        shutil.copytree(runs["fedavg"], tmp_path / group / "seed0")
    loaded = load_runs([tmp_path / "a" / "seed0", tmp_path / "b" / "seed0"])
    assert [r.name for r in loaded] == ["a/seed0", "b/seed0"]


def test_a_directory_without_summary_is_named(runs, tmp_path, capsys):
    unfinished = tmp_path / "unfinished"
    shutil.copytree(runs["fedavg"], unfinished)
    os.remove(unfinished / "summary.json")
    assert main(["compare", runs["fedavg"], str(unfinished), "--out",
                 str(tmp_path / "p.png")]) == 1
    err = capsys.readouterr().err
    assert f"{unfinished}: no summary.json" in err and "did not finish" in err
    assert not (tmp_path / "p.png").exists()


def test_missing_directory_and_bad_target_are_errors(runs, tmp_path, capsys):
    assert main(["compare", str(tmp_path / "nope"), "--out", str(tmp_path / "p.png")]) == 1
    assert f"{tmp_path / 'nope'}: no such directory" in capsys.readouterr().err
    assert main(["compare", runs["fedavg"], "--target", "80", "--out",
                 str(tmp_path / "p.png")]) == 1
    assert "did you mean 0.8?" in capsys.readouterr().err


def test_a_malformed_metrics_line_is_located(runs, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(runs["fedavg"], broken)
    with open(broken / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    _, history = read_files(runs["fedavg"])
    with pytest.raises(ValueError, match=rf"metrics.jsonl, line {len(history) + 1}: not valid JSON"):
        load_run(broken)


def test_duw_offline_training_time_is_shown_apart(runs, tmp_path, capsys):
    run = tmp_path / "duw_like"
    shutil.copytree(runs["fedavg"], run)
    (run / "duw_weights.json").write_text(json.dumps({"format": "edgefl-duw-weights",
                                                      "wall_s": 12.5}))
    assert load_run(run).offline_s == 12.5
    assert main(["compare", str(run), "--out", str(tmp_path / "p.png")]) == 0
    assert "(+12.5 s offline)" in capsys.readouterr().out


def test_human_units():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 1024 ** 2) == "3.00 MiB"
    assert format_bytes(15.5 * 1024 ** 2) == "15.5 MiB"
    assert format_bytes(2 * 1024 ** 3) == "2.00 GiB"
    assert format_duration(0.5) == "0.50 s" and format_duration(75) == "1m15s"
    assert format_duration(3725) == "1h02m"


def broken_copy(runs, tmp_path, name="L", summary=None, metrics_line=None):
    """A copy of the FedAvg run with summary.json replaced and/or a metrics line appended."""
    run = tmp_path / name
    shutil.copytree(runs["fedavg"], run)
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    if metrics_line is not None:
        with open(run / "metrics.jsonl", "a") as f:
            f.write(metrics_line + "\n")
    return run


def refused(argv, capsys):
    """(exit status, the one stderr line) of `edgefl compare`, which must print no table."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err, (out, err)
    assert len(err.splitlines()) == 1, err
    return code, err.strip()


@pytest.mark.parametrize("field, value, message", [
    ("final_accuracy", "abc", "final_accuracy must be a number, got 'abc'"),
    ("best_accuracy", True, "best_accuracy must be a number, got True"),
    ("best_round", "3", "best_round must be a whole number >= 0, got '3'"),
    ("uplink_bytes", -5, "uplink_bytes must be a whole number >= 0, got -5"),
    ("wall_s", [1], "wall_s must be a number >= 0, got [1]"),
    ("rounds", 2.5, "rounds must be a whole number >= 0, got 2.5"),
    ("config", "fedavg", "config must be an object, got 'fedavg'"),
])
@pytest.mark.parametrize("json_out", [False, True])
def test_a_malformed_summary_field_is_named_with_its_file(runs, tmp_path, capsys, field, value,
                                                          message, json_out):
    # the table used to fail formatting it ("Unknown format code 'f' for object of type
    # 'str'", no file named) and --json passed it through as if it were the run's result
    summary, _ = read_files(runs["fedavg"])
    run = broken_copy(runs, tmp_path, summary={**summary, field: value})
    png = tmp_path / "p.png"
    argv = ["compare", runs["fedavg"], str(run), "--out", str(png)] + (["--json"] * json_out)
    assert refused(argv, capsys) == (1, f"edgefl compare: error: {run}/summary.json: {message}")
    assert not png.exists()


def test_a_summary_without_the_runs_config_is_refused(runs, tmp_path, capsys):
    # {} gave a row of "?": every summary.json edgefl writes, a stopped run's too, has the
    # run's config and its rounds, so one without them is not a run's summary
    run = broken_copy(runs, tmp_path, summary={})
    assert refused(["compare", str(run), "--no-plot"], capsys) == (
        1, f"edgefl compare: error: {run}/summary.json: no config (the run's configuration, "
           f"which every summary.json of `edgefl simulate` holds)")


def test_a_metrics_line_with_a_malformed_field_is_located(runs, tmp_path, capsys):
    _, history = read_files(runs["fedavg"])
    where = f"metrics.jsonl, line {len(history) + 1}"
    for line, message in [('{"round": "x"}', "round must be a whole number >= 0, got 'x'"),
                          ('{"round": 7, "test_accuracy": "0.9"}',
                           "test_accuracy must be a number, got '0.9'")]:
        run = broken_copy(runs, tmp_path, name=f"m{len(line)}", metrics_line=line)
        assert refused(["compare", str(run), "--no-plot", "--json"], capsys) == (
            1, f"edgefl compare: error: {run}/{where}: {message}")


def test_a_stopped_runs_summary_without_accuracy_is_compared(runs, tmp_path, capsys):
    # A run stopped (SIGINT/SIGTERM) before any evaluated round writes summary.json without
    # accuracy, bytes or wall time (runs.outputs.stopped_summary, docs/reliability.md): that
    # is a legitimate summary, shown with "–" where the numbers are unknown
    summary, _ = read_files(runs["fedavg"])
    stopped = {key: summary[key] for key in ("rounds", "n_params", "workers", "backend",
                                             "edgefl_version", "config")}
    stopped["stopped"] = {"reason": "stop_requested", "in_round": 2, "rounds_done": 1,
                          "rounds_planned": 6, "message": "stopped by SIGTERM in round 2"}
    run = broken_copy(runs, tmp_path, summary=stopped)
    assert main(["compare", str(run), "--no-plot"]) == 0
    row = table_rows(capsys.readouterr().out)["L"]
    assert row["final acc"] == "–" and row["best acc (round)"] == "–" and row["wall"] == "–"
    assert row["up+down bytes"] == "–"       # unknown, not "0 B"
    assert main(["compare", str(run), "--no-plot", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["runs"][0]
    assert row["final_accuracy"] is None and row["wall_s"] is None and row["bytes"] is None
    # null byte counts (as a hand-edited or foreign summary may have) are unknown as well
    run = broken_copy(runs, tmp_path / "null", summary={**summary, "uplink_bytes": None})
    assert main(["compare", str(run), "--no-plot"]) == 0
    assert table_rows(capsys.readouterr().out)["L"]["up+down bytes"] == "–"


def test_a_run_going_on_in_an_earlier_runs_directory_is_refused(runs, tmp_path, capsys):
    # `simulate --out DIR --force` into a finished run's directory started metrics.jsonl
    # afresh while the earlier run's summary.json stayed until the new run ended. compare
    # read that mix as one run: the old run's final and best accuracy beside the new run's
    # rounds to target and curves, silently. The new run now removes the earlier run's
    # outputs as it takes the directory (runs.outputs MetricsLog), so compare says it is no
    # finished run; a directory an older edgefl left so (or copied together by hand) is
    # refused by its two counts of rounds. A real simulate, compared while it runs.
    import signal
    import subprocess
    import sys
    import time

    run = tmp_path / "reused"
    shutil.copytree(runs["fedavg"], run)
    summary, _ = read_files(run)
    config = tmp_path / "long.yaml"
    config.write_text(json.dumps(dict(BASE, strategy={"name": "fedavg"}, rounds=100000)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-m", "edgefl.cli", "simulate", str(config),
                             "--out", str(run), "--force", "--quiet", "--no-plot",
                             "--no-export", "--workers", "1"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:     # the new run has written more rounds than the old summary counts
            assert proc.poll() is None, proc.stderr.read().decode()
            lines = (run / "metrics.jsonl").read_text().count("\n")
            if lines > summary["rounds"] + 1:
                break
            assert time.monotonic() < deadline, "the new run wrote too few rounds"
            time.sleep(0.05)
        assert not (run / "summary.json").exists()
        code, err = refused(["compare", str(run), "--no-plot"], capsys)
        assert code == 1 and f"{run}: no summary.json" in err and "still running" in err
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    shutil.copy(os.path.join(runs["fedavg"], "summary.json"), run / "summary.json")  # older
    code, err = refused(["compare", str(run), "--no-plot", "--json"], capsys)
    assert code == 1 and f"{run}: summary.json counts {summary['rounds']} rounds" in err
    assert "metrics.jsonl holds" in err
