"""Runs never overwrite: `edgefl simulate`, `export`, `partition` and `duw-train` refuse to
replace earlier work without --force (exit 2, nothing touched), and simulate without --out
gives every run a directory of its own with runs/NAME linking to the latest."""
import json
import os
import re

import pytest
import yaml

from edgefl.cli import destinations, main
from helpers import SMALL_RUN, refused_port, usage_error

# the roles' small run (all three clients every round), as tiny.yaml
TINY = {**SMALL_RUN, "clients_per_round": 3}
STAMPED = re.compile(r"tiny-\d{8}-\d{6}(-\d+)?")


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """A fresh working directory holding tiny.yaml."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    return tmp_path


def simulate(*extra):
    return main(["simulate", "tiny.yaml", "--quiet", "--workers", "1", *extra])


def one_line_error(capsys, command):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"edgefl {command}: error: "), err
    return err[0]


# ---------------------------------------------------------------------------------------
# simulate --out DIR
# ---------------------------------------------------------------------------------------

def test_a_non_empty_out_dir_is_refused_and_left_untouched(cwd, capsys):
    (cwd / "old").mkdir()
    (cwd / "old" / "summary.json").write_bytes(b'{"earlier": "run"}\n')
    assert simulate("--out", "old") == 2
    err = one_line_error(capsys, "simulate")
    assert "--out old: directory is not empty" in err and "--force" in err
    assert os.listdir(cwd / "old") == ["summary.json"]
    assert (cwd / "old" / "summary.json").read_bytes() == b'{"earlier": "run"}\n'
    assert not (cwd / "runs").exists()


def test_force_writes_into_a_non_empty_out_dir(cwd, capsys):
    (cwd / "old").mkdir()
    (cwd / "old" / "notes.txt").write_text("mine")
    assert simulate("--out", "old", "--force") == 0
    assert json.loads((cwd / "old" / "summary.json").read_text())["rounds"] == 2
    assert (cwd / "old" / "notes.txt").read_text() == "mine"          # nothing deleted
    assert "outputs in old" in capsys.readouterr().out


@pytest.mark.parametrize("export_every", [None, "1"])
def test_force_over_a_finished_run_that_diverges_leaves_no_output_of_the_earlier_run(
        cwd, capsys, export_every):
    # A run forced into an earlier run's directory that diverged in round 1 left the
    # earlier run's summary.json (its accuracy, its config), model.npz, model.onnx and
    # curves.png beside its own empty metrics.jsonl: the directory said the run had
    # succeeded. Once the new run has started, none of the earlier run's outputs may stay.
    (cwd / "prev" / "sub").mkdir(parents=True)
    (cwd / "prev" / "notes.txt").write_text("mine")
    assert simulate("--out", "prev", "--force") == 0
    assert {"summary.json", "model.npz", "model.onnx", "curves.png"} <= \
        set(os.listdir(cwd / "prev"))
    capsys.readouterr()
    extra = ["--export-every", export_every] if export_every else []
    assert simulate("--out", "prev", "--force", "--set", "train.lr=1e38", *extra) == 1
    assert "training diverged" in capsys.readouterr().err
    assert sorted(os.listdir(cwd / "prev")) == ["metrics.jsonl", "notes.txt", "sub"]
    assert (cwd / "prev" / "metrics.jsonl").read_text() == ""
    assert (cwd / "prev" / "notes.txt").read_text() == "mine"          # not an output


def test_an_empty_existing_out_dir_is_fine(cwd):
    (cwd / "empty").mkdir()
    assert simulate("--out", "empty") == 0
    assert (cwd / "empty" / "model.npz").is_file()
    assert not (cwd / "runs").exists()                 # --out: no link made


def test_an_out_that_is_a_file_is_refused(cwd, capsys):
    (cwd / "f").write_text("x")
    assert simulate("--out", "f", "--force") == 2
    assert "--out f: exists and is not a directory" in one_line_error(capsys, "simulate")
    assert (cwd / "f").read_text() == "x"
    # under a file: refused before any round (it trained round 1, then said "[Errno 20]
    # Not a directory" naming no option)
    assert simulate("--out", "f/sub/run") == 2
    assert "--out f/sub/run: f is not a directory" in one_line_error(capsys, "simulate")


# ---------------------------------------------------------------------------------------
# simulate without --out: runs/NAME-YYYYmmdd-HHMMSS and the runs/NAME link
# ---------------------------------------------------------------------------------------

def test_each_run_gets_its_own_directory_and_the_link_follows_the_latest(cwd, capsys):
    assert simulate() == 0
    first = capsys.readouterr().out
    assert simulate("--set", "seed=1") == 0
    second = capsys.readouterr().out
    runs = sorted(os.listdir(cwd / "runs"))
    stamped = [d for d in runs if STAMPED.fullmatch(d)]
    assert len(stamped) == 2 and set(runs) == {*stamped, "tiny"}, runs
    link = cwd / "runs" / "tiny"
    assert link.is_symlink() and not os.path.isabs(os.readlink(link))
    seeds = {d: json.loads((cwd / "runs" / d / "summary.json").read_text())["config"]["seed"]
             for d in stamped}
    latest = next(d for d, seed in seeds.items() if seed == 1)
    assert os.readlink(link) == latest
    assert json.loads((link / "summary.json").read_text())["config"]["seed"] == 1
    assert f"outputs in {os.path.join('runs', latest)} (runs/tiny links to it)" in second
    assert f"outputs in {os.path.join('runs', latest)}" not in first
    assert not [f for f in runs if f.startswith(".")]             # no temporary link left


def test_runs_started_in_the_same_second_get_a_numeric_suffix(cwd):
    now = 1_700_000_000.0
    a = destinations.new_run_dir("tiny", now=now)
    b = destinations.new_run_dir("tiny", now=now)
    c = destinations.new_run_dir("tiny", now=now)
    assert b == f"{a}-2" and c == f"{a}-3"
    assert all(os.path.isdir(p) for p in (a, b, c))


def test_a_real_runs_name_directory_is_left_alone_and_said_so(cwd, capsys):
    old = cwd / "runs" / "tiny"
    old.mkdir(parents=True)
    (old / "summary.json").write_bytes(b"from an older edgefl")
    assert simulate() == 0
    captured = capsys.readouterr()
    notes = captured.err.strip().splitlines()
    assert len(notes) == 1 and "runs/tiny is not the link to the latest run" in notes[0] \
        and "left as it is" in notes[0], notes
    assert not old.is_symlink() and os.listdir(old) == ["summary.json"]
    assert (old / "summary.json").read_bytes() == b"from an older edgefl"
    stamped = [d for d in os.listdir(cwd / "runs") if STAMPED.fullmatch(d)]
    assert len(stamped) == 1 and (cwd / "runs" / stamped[0] / "model.npz").is_file()
    assert "links to it" not in captured.out


def test_a_run_that_fails_before_writing_leaves_no_directory_and_keeps_the_link(cwd, capsys):
    assert simulate() == 0
    before = os.readlink(cwd / "runs" / "tiny")
    # a data set that cannot load: the run fails in its preparation, before any output
    assert simulate("--set", "dataset.name=fashion-mnist", "--set", "dataset.path=/none") == 1
    assert "edgefl simulate: error:" in capsys.readouterr().err
    assert sorted(os.listdir(cwd / "runs")) == sorted([before, "tiny"])
    assert os.readlink(cwd / "runs" / "tiny") == before


# ---------------------------------------------------------------------------------------
# export, partition, duw-train: an existing file is refused without --force
# ---------------------------------------------------------------------------------------

@pytest.fixture
def run_dir(cwd):
    assert simulate("--out", "run") == 0
    return cwd / "run"


def test_export_refuses_an_existing_out_file_and_force_replaces_it(run_dir, cwd, capsys):
    (cwd / "m.onnx").write_bytes(b"keep me")
    assert main(["export", "run", "--out", "m.onnx"]) == 2
    err = one_line_error(capsys, "export")
    assert "--out m.onnx: file exists; pass --force to replace it" in err
    assert (cwd / "m.onnx").read_bytes() == b"keep me"
    assert main(["export", "run", "--out", "m.onnx", "--force"]) == 0
    assert (cwd / "m.onnx").read_bytes() != b"keep me" and "to m.onnx" in capsys.readouterr().out
    # a directory is never replaced, --force or not
    (cwd / "d.onnx").mkdir()
    assert main(["export", "run", "--out", "d.onnx", "--force"]) == 2
    assert "--out d.onnx: is a directory" in one_line_error(capsys, "export")


def test_export_without_out_replaces_the_runs_own_onnx_file(run_dir):
    before = (run_dir / "model.onnx").read_bytes()
    assert main(["export", "run", "--no-softmax"]) == 0       # derived from model.npz beside it
    assert (run_dir / "model.onnx").read_bytes() != before


def test_partition_refuses_an_existing_heatmap_and_force_replaces_it(cwd, capsys):
    (cwd / "heat.png").write_bytes(b"keep me")
    assert main(["partition", "tiny.yaml", "--out", "heat.png"]) == 2
    assert "--out heat.png: file exists" in one_line_error(capsys, "partition")
    assert (cwd / "heat.png").read_bytes() == b"keep me"
    assert capsys.readouterr().out == ""                # refused before the table too
    assert main(["partition", "tiny.yaml", "--out", "heat.png", "--force"]) == 0
    assert (cwd / "heat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the default file is held to the same rule; --no-plot writes nothing, so checks nothing
    (cwd / "partition.png").write_bytes(b"mine")
    assert main(["partition", "tiny.yaml"]) == 2
    assert "--out partition.png: file exists" in one_line_error(capsys, "partition")
    assert main(["partition", "tiny.yaml", "--no-plot"]) == 0
    assert (cwd / "partition.png").read_bytes() == b"mine"


def test_duw_train_refuses_an_existing_weight_file_and_force_replaces_it(cwd, capsys):
    duw = {**TINY, "strategy": {"name": "duw", "meta_iterations": 2, "meta_lr": 0.01}}
    (cwd / "duw.yaml").write_text(yaml.safe_dump(duw))
    (cwd / "w.json").write_bytes(b"keep me")
    argv = ["duw-train", "duw.yaml", "--out", "w.json", "--quiet", "--workers", "1"]
    assert main(argv) == 2
    assert "--out w.json: file exists; pass --force" in one_line_error(capsys, "duw-train")
    assert (cwd / "w.json").read_bytes() == b"keep me"
    assert main([*argv, "--force"]) == 0
    doc = json.loads((cwd / "w.json").read_text())
    assert doc["format"] == "edgefl-duw-weights" and doc["rounds"] == 2


def test_compare_refuses_an_existing_plot_and_force_replaces_it(run_dir, cwd, capsys):
    (cwd / "compare.png").write_bytes(b"keep me")
    assert main(["compare", "run"]) == 2            # the default file too
    assert "--out compare.png: file exists; pass --force" in one_line_error(capsys, "compare")
    assert (cwd / "compare.png").read_bytes() == b"keep me"
    assert capsys.readouterr().out == ""             # refused before the table
    assert main(["compare", "run", "--no-plot"]) == 0
    assert "overlay plot" not in capsys.readouterr().out
    assert (cwd / "compare.png").read_bytes() == b"keep me"
    assert main(["compare", "run", "--force"]) == 0
    assert (cwd / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------
# simulate: --force needs --out; --no-plot, --no-export; the lines around the rounds
# ---------------------------------------------------------------------------------------

def test_force_without_out_is_an_error_that_says_why(cwd, capsys):
    assert simulate("--force") == 2
    err = one_line_error(capsys, "simulate")
    assert "--force only applies to --out DIR" in err and "new directory under runs/" in err
    assert not (cwd / "runs").exists()


def test_no_plot_and_no_export_leave_those_files_out(cwd, capsys):
    assert simulate("--out", "bare", "--no-plot", "--no-export") == 0
    assert sorted(os.listdir(cwd / "bare")) == ["metrics.jsonl", "model.npz", "summary.json"]
    assert main(["simulate", "tiny.yaml", "--no-export", "--export-every", "1"]) == 2
    assert "--no-export and --export-every 1 contradict" in one_line_error(capsys, "simulate")
    assert main(["export", "bare"]) == 0                 # what --no-export's help promises
    assert (cwd / "bare" / "model.onnx").is_file()


def test_loading_export_and_plot_each_say_what_they_did(cwd, capsys):
    assert main(["simulate", "tiny.yaml", "--workers", "1", "--out", "o"]) == 0
    err = capsys.readouterr().err.splitlines()
    data = [i for i, line in enumerate(err) if line.startswith("data: ")]
    export = [i for i, line in enumerate(err) if line.startswith("export: ")]
    plot = [i for i, line in enumerate(err) if line.startswith("plot: ")]
    rounds = [i for i, line in enumerate(err) if line.startswith("round ")]
    assert len(data) == len(export) == len(plot) == 1, err
    assert data[0] < rounds[0] and export[0] > rounds[0] and plot[0] > rounds[-1], err
    assert re.fullmatch(r"data: digits, \d+ train / \d+ test samples, 3 clients \(\d+\.\d\d s\)",
                        err[data[0]]), err
    size = os.path.getsize(cwd / "o" / "model.onnx")
    assert err[export[0]].startswith(f"export: {os.path.join('o', 'model.onnx')}, {size:,} bytes (")
    assert err[plot[0]].startswith(f"plot: {os.path.join('o', 'curves.png')} (")
    # --quiet: none of them
    assert main(["simulate", "tiny.yaml", "--workers", "1", "--out", "q", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_a_warning_is_one_line_naming_the_file_not_the_source(cwd):
    """On the command line a warning (here the old `fleet:` key) is one line for the user,
    naming the run config and the key, not the edgefl source line that raised it."""
    import subprocess
    import sys
    config = {**TINY, "fleet": {"rpi4": 1.0}}
    (cwd / "old.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "edgefl.cli", "simulate", "old.yaml",
                           "--quiet", "--no-plot", "--no-export", "--workers", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "edgefl: warning: old.yaml: fleet: is deprecated, rename it sim_fleet: (the simulated "
        "fleet of the virtual clock; `edgefl fleet` is another thing) (FutureWarning)"]


def test_a_parameter_written_as_the_docs_write_it_runs(cwd):
    # docs/algorithms.md gives FedAdam's tau as 1e-3; typed so it was refused as a string
    assert main(["simulate", "quickstart", "--set", "rounds=1", "--set", "strategy.name=fedadam",
                 "--set", "strategy.tau=1e-3", "--no-plot", "--no-export", "--quiet",
                 "--out", "adam"]) == 0
    summary = json.loads((cwd / "adam" / "summary.json").read_text())
    assert summary["config"]["strategy"]["tau"] == 0.001


def test_lines_stay_whole_when_two_commands_write_to_one_output_unbuffered(tmp_path):
    """Under PYTHONUNBUFFERED (set on some machines, and so in CI) print() wrote a line and
    its newline in two system calls, and `edgefl ctl watch ... & edgefl ctl start ...` in
    docs/orchestration.md printed a line of one glued to a line of the other. Through the
    console entry point each line is written whole: two processes printing 3,000 lines each
    into one shared output at once (a file both inherit, as from a shell's redirection)
    never split one. Without it, even the `--version` lines came out glued."""
    import subprocess
    import sys
    script = ("import sys\n"
              "from edgefl import cli\n"
              "try:\n"
              "    cli.console_main(['--version'])\n"
              "except SystemExit:\n"
              "    pass\n"
              "print(sys.stdout.write_through, sys.stdout.line_buffering)\n"
              "for i in range(3000):\n"
              "    print(f'{sys.argv[1]} {i:04d} ' + 'x' * 40)\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "out.txt", "wb") as out:
        procs = [subprocess.Popen([sys.executable, "-c", script, tag], stdout=out, env=env)
                 for tag in ("a", "b")]
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
    lines = (tmp_path / "out.txt").read_text().splitlines()
    version = [line for line in lines if line.startswith("edgefl ")]
    assert len(version) == 2
    assert lines.count("False True") == 2          # write-through off, line buffering on
    body = [line for line in lines if line not in version and line != "False True"]
    bad = [line for line in body if not re.fullmatch(r"[ab] \d{4} x{40}", line)]
    assert not bad, bad[:5]
    assert sorted(body) == sorted(f"{t} {i:04d} " + "x" * 40 for t in "ab" for i in range(3000))


# ---------------------------------------------------------------------------------------
# simulate --transport mqtt: a run that cannot start (bad transport settings, no broker)
# says why in one line and leaves every directory as it was
# ---------------------------------------------------------------------------------------

QUICK = ["quickstart", "--set", "rounds=2", "--no-plot", "--no-export", "--quiet"]


def refused_broker() -> str:
    """mqtt:// URL of a port on 127.0.0.1 where nobody listens: connecting is refused."""
    return f"mqtt://127.0.0.1:{refused_port()}"


def tree(path) -> dict:
    """Every file under `path` and its bytes: what a failed run must leave as it found it."""
    return {os.path.relpath(os.path.join(d, f), path): open(os.path.join(d, f), "rb").read()
            for d, _dirs, files in os.walk(path) for f in files}


@pytest.mark.parametrize("processes", [None, "1", "0"])
def test_an_unreachable_broker_is_one_line_naming_it_and_creates_nothing(cwd, processes):
    # a subprocess, as a user runs it: with worker processes (the default) this was a
    # traceback ending in "client worker 0 ... died with exit code 0", the cause lost
    import subprocess
    import sys

    url = refused_broker()
    extra = [] if processes is None else ["--client-processes", processes]
    proc = subprocess.run([sys.executable, "-m", "edgefl.cli", "simulate", *QUICK,
                           "--transport", "mqtt", "--broker", url, "--out", "m2", *extra],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"edgefl simulate: error: cannot reach MQTT broker "
                     f"{url.removeprefix('mqtt://')}: Connection refused"], lines
    assert not (cwd / "m2").exists()              # so the corrected command is not refused


def test_a_worker_whose_clients_cannot_connect_reports_the_brokers_error(cwd, capsys,
                                                                        monkeypatch):
    # the broker goes away after the simulating process found it and before the worker
    # processes' clients connect: skip that first check (simulate's, before the run is
    # prepared), and the workers meet the refusal
    import edgefl.sim

    probes = []
    monkeypatch.setattr(edgefl.sim, "reach_broker", lambda *args: probes.append(args))
    url = refused_broker()
    assert main(["simulate", *QUICK, "--transport", "mqtt", "--broker", url, "--out", "m2",
                 "--client-processes", "2"]) == 1
    err = one_line_error(capsys, "simulate")
    assert err.endswith(f"cannot reach MQTT broker {url.removeprefix('mqtt://')}: "
                        f"Connection refused"), err
    assert not (cwd / "m2").exists()
    assert len(probes) == 1                  # the check was skipped, not passed


def test_an_unreachable_broker_is_found_before_the_run_is_prepared(cwd, capsys, monkeypatch):
    # a strategy's offline phase (DUW's) runs while the run is prepared, and writes into the
    # run's directory: the broker is reached first
    import edgefl.sim

    def prepared(*args, **kwargs):
        raise AssertionError("the run was prepared before the broker was reached")

    monkeypatch.setattr(edgefl.sim, "prepare_run", prepared)
    url = refused_broker()
    assert main(["simulate", *QUICK, "--transport", "mqtt", "--broker", url, "--out", "m4"]) == 1
    assert "cannot reach MQTT broker" in one_line_error(capsys, "simulate")
    assert not (cwd / "m4").exists()


@pytest.mark.parametrize("option, message", [
    (["--broker", "foo://x"], "broker URL 'foo://x': scheme 'foo' is not one of"),
    (["--chunk-size", "0"], "--chunk-size (transport.chunk_size): 0 is below the minimum 1024"),
    (["--broker", "mqtt://127.0.0.1:1"], "cannot reach MQTT broker 127.0.0.1:1"),
])
def test_a_bad_transport_setting_creates_no_run_directory(cwd, capsys, option, message):
    assert main(["simulate", *QUICK, "--transport", "mqtt", *option, "--out", "m3"]) == 1
    assert message in one_line_error(capsys, "simulate")
    assert not (cwd / "m3").exists()
    # and without --out: no runs/quickstart-* directory is left behind either
    assert main(["simulate", *QUICK, "--transport", "mqtt", *option]) == 1
    assert message in one_line_error(capsys, "simulate")
    assert not (cwd / "runs").exists() or os.listdir(cwd / "runs") == []


def test_force_over_a_finished_run_keeps_its_files_when_the_broker_is_unreachable(cwd,
                                                                                   capsys):
    assert main(["simulate", *QUICK, "--out", "prev"]) == 0
    before = tree(cwd / "prev")
    assert {"metrics.jsonl", "summary.json", "model.npz"} <= set(before)
    assert before["metrics.jsonl"].count(b"\n") == 2
    capsys.readouterr()
    for option in (["--broker", refused_broker()], ["--broker", "foo://x"],
                   ["--chunk-size", "0"]):
        assert main(["simulate", *QUICK, "--transport", "mqtt", *option, "--out", "prev",
                     "--force"]) == 1
        one_line_error(capsys, "simulate")
        assert tree(cwd / "prev") == before, option     # byte for byte, metrics.jsonl too
    # and the old run is still whole: compare reads it
    assert main(["compare", "prev", "--no-plot"]) == 0


@pytest.mark.parametrize("command", ["simulate", "duw-train"])
def test_workers_below_one_is_refused_while_parsing(cwd, capsys, command):
    # --workers is checked by the same argument type as predict's --top and --limit
    # (edgefl.cli.command.count): one message, before the config is read or --out made
    assert usage_error([command, "tiny.yaml", "--workers", "0", "--out", "o"], capsys) == (
        f"edgefl {command}: error: argument --workers: need a whole number >= 1, got 0")
    assert sorted(os.listdir(cwd)) == ["tiny.yaml"]
