"""Retention of the aggregator service's ended runs (roles/retention.py): the site file's
`retention.keep_runs`, applied by the service as each run ends, and `edgefl prune`. Real
runs through the ACL broker (test_orchestration's fleet), real files, the command as a
process."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest_plugins = ["brokers"]
pytest.register_assert_rewrite("brokers")     # imported by test_orchestration

import test_orchestration as orchestration  # noqa: E402
from edgefl.config import ConfigError  # noqa: E402
from edgefl.roles import AggregatorCheckpoint  # noqa: E402
from edgefl.roles.daemon import RunStore  # noqa: E402
from edgefl.service.layered import load_service_config  # noqa: E402
from helpers import wait_for  # noqa: E402

fleet = orchestration.fleet
run_config, wait_state = orchestration.run_config, orchestration.wait_state


def files_of(root) -> dict:
    """{relative path: (size, mtime_ns)} of every file and link under root (links not
    followed)."""
    out = {}
    for parent, dirs, files in os.walk(root):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(parent, d))]:
            path = os.path.join(parent, name)
            st = os.lstat(path)
            out[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return out


def under(files: dict, run_id: str) -> dict:
    return {k: v for k, v in files.items() if k.startswith(f"runs{os.sep}{run_id}{os.sep}")}


def prune(site, *args):
    return subprocess.run([sys.executable, "-m", "edgefl.cli", "prune", "--config", str(site),
                           *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def site_file(tmp_path, state_dir, extra="") -> str:
    path = tmp_path / "aggregator.yaml"
    path.write_text(f"node: {{id: aggregator}}\nstate_dir: {state_dir}\n{extra}")
    return str(path)


# ---------------------------------------------------------------------------------------
# the setting
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["-1", "0", "2.5", "two"])
def test_a_bad_keep_runs_is_refused_at_load_naming_the_key_and_the_file(tmp_path, value):
    site = site_file(tmp_path, tmp_path / "state", f"retention:\n  keep_runs: {value}\n")
    with pytest.raises(ConfigError) as err:
        load_service_config("aggregator", site)
    assert f"{site}:4: retention.keep_runs" in str(err.value), err.value


def test_keep_runs_is_unset_by_default_and_read_from_the_site_file(tmp_path):
    assert load_service_config("aggregator", site_file(tmp_path, tmp_path / "s"))[
        "retention.keep_runs"] is None
    site = site_file(tmp_path, tmp_path / "s", "retention: {keep_runs: 3}\n")
    assert load_service_config("aggregator", site)["retention.keep_runs"] == 3


# ---------------------------------------------------------------------------------------
# the service applies it as each run ends
# ---------------------------------------------------------------------------------------

def test_the_service_keeps_the_files_of_its_newest_runs_only(fleet):
    """keep_runs 1 and three runs: the two older runs' files are removed as the newer ones
    end; their records stay, marked pruned, in the listing and on the runs topic."""
    f = fleet(keep_runs=1)
    f.start_all()
    for run_id in ("r1", "r2", "r3"):
        f.run_to_end(run_config(rounds=1), run_id)
    runs = wait_for(lambda: (lambda rs: rs if all(rs[r].get("pruned") for r in ("r1", "r2"))
                             else None)({r["id"]: r for r in f.ok({"cmd": "runs"})["runs"]}),
                    what="r1 and r2 pruned")
    assert "pruned" not in runs["r3"] and runs["r3"]["state"] == "finished"
    for run_id in ("r1", "r2"):
        assert sorted(os.listdir(f.state_dir / "runs" / run_id)) == ["run.json"]
        assert runs[run_id]["state"] == "finished" and runs[run_id]["pruned_bytes"] > 0
    r3 = f.state_dir / "runs" / "r3"
    assert {"model.onnx", "model.npz", "summary.json", "metrics.jsonl", "run.json",
            "state"} <= set(os.listdir(r3))
    assert AggregatorCheckpoint.load(r3 / "state").round == 1
    on_disk = {r["id"]: r for r in RunStore(str(f.state_dir)).load_all()}
    assert list(on_disk) == ["r1", "r2", "r3"] and on_disk["r1"]["pruned"]
    # an export of a pruned run says why there is nothing to export
    reply = f.control().request({"cmd": "export", "run": "r1"}, timeout=20)
    assert not reply["ok"] and "pruned" in reply["error"], reply


# ---------------------------------------------------------------------------------------
# edgefl prune
# ---------------------------------------------------------------------------------------

def test_prune_dry_run_removes_nothing_and_prune_spares_the_paused_run_which_resumes(
        fleet, tmp_path):
    f = fleet()
    f.start_all()
    for run_id in ("r1", "r2"):
        f.run_to_end(run_config(rounds=1), run_id)
    f.ok({"cmd": "start", "config": run_config(rounds=20), "run": "r3"})
    f.events.wait("round_opened", run="r3", round=1)
    f.ok({"cmd": "pause"})
    f.close()                      # a service stop: r3 stays paused, to be resumed
    site = site_file(tmp_path, f.state_dir)
    before = files_of(f.state_dir)

    dry = prune(site, "--keep", "0", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert files_of(f.state_dir) == before                  # nothing removed
    doomed = {**under(before, "r1"), **under(before, "r2")}
    doomed = {k: v for k, v in doomed.items() if not k.endswith(f"{os.sep}run.json")}
    total = sum(size for size, _ in doomed.values())
    assert f"would remove 2 run(s), {total} bytes" in dry.stdout, dry.stdout
    assert "r3" not in dry.stdout.replace(str(f.state_dir), "")

    done = prune(site, "--keep", "0")
    assert done.returncode == 0, done.stderr
    assert f"removed 2 run(s), {total} bytes" in done.stdout, done.stdout
    after = files_of(f.state_dir)
    assert under(after, "r3") == under(before, "r3")         # the paused run untouched
    for run_id in ("r1", "r2"):
        assert list(under(after, run_id)) == [os.path.join("runs", run_id, "run.json")]
    records = {r["id"]: r for r in RunStore(str(f.state_dir)).load_all()}
    assert records["r1"]["pruned"] and records["r3"]["state"] == "paused"
    assert "pruned" not in records["r3"]

    again = prune(site, "--keep", "0")                       # nothing left to do
    assert again.returncode == 0 and "removed 0 run(s), 0 bytes" in again.stdout

    g = fleet(tag=f.tag)                     # the service again, same federation: r3 resumes
    g.start_all()
    g.ok({"cmd": "resume", "run": "r3"})
    wait_state(g, "r3", "finished", timeout=120)
    ckpt = AggregatorCheckpoint.load(g.state_dir / "runs" / "r3" / "state")
    assert ckpt.aggregated == list(range(1, 21))


def _ended_run(root, run_id, seq, files):
    """A run directory as the service leaves an ended run: its record and files."""
    run_dir = root / "runs" / run_id
    (run_dir / "state").mkdir(parents=True)
    for name, data in files.items():
        (run_dir / name).write_bytes(data)
    record = {"id": run_id, "seq": seq, "state": "finished", "site": None, "config": None,
              "created": 1000.0 + seq, "ended": 2000.0 + seq, "run_dir": str(run_dir),
              "state_dir": str(run_dir / "state"), "out_dir": str(run_dir)}
    (run_dir / "run.json").write_text(json.dumps(record))
    return run_dir


def _immutable(path) -> bool:
    """Make `path` a file its owner cannot remove: root, chattr +i; otherwise its
    directory read-only."""
    if os.geteuid() != 0:
        os.chmod(os.path.dirname(path), 0o500)
        return True
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0


def _mutable(path) -> None:
    if os.geteuid() != 0:
        os.chmod(os.path.dirname(path), 0o700)
    else:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)


def test_prune_reports_a_failed_removal_by_path_goes_on_and_follows_no_link(tmp_path):
    state = tmp_path / "state"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"x" * 100)
    r1 = _ended_run(state, "r1", 1, {"model.onnx": b"a" * 10, "state/aggregator.npz": b"b" * 20})
    (r1 / "state" / "escape").symlink_to(outside)           # a link out: removed, not followed
    (r1 / "to-precious").symlink_to(outside / "precious")
    r2 = _ended_run(state, "r2", 2, {"model.onnx": b"c" * 30, "state/rounds.jsonl": b"d" * 40})
    stuck = r2 / "state" / "rounds.jsonl"
    _ended_run(state, "r3", 3, {"model.onnx": b"e" * 50})
    # a run directory that is itself a link out of the state directory: left alone
    (outside / "run.json").write_text(json.dumps({"id": "r0", "seq": 0, "state": "finished",
                                                  "ended": 1.0}))
    (state / "runs" / "r0").symlink_to(outside)
    if not _immutable(stuck):
        pytest.skip("cannot make a file unremovable here (chattr +i refused)")
    try:
        site = site_file(tmp_path, state)
        result = prune(site, "--keep", "1")
    finally:
        _mutable(stuck)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert f"cannot remove {stuck}: Operation not permitted" in result.stderr or \
        f"cannot remove {stuck}: Permission denied" in result.stderr, result.stderr
    assert "r0" in result.stderr and "symbolic link" in result.stderr, result.stderr
    # r1 wholly pruned (the links removed, their targets untouched), r2 as far as it could
    assert files_of(r1) == {"run.json": files_of(r1)["run.json"]}
    assert sorted(os.listdir(outside)) == ["precious", "run.json"]
    assert (outside / "precious").read_bytes() == b"x" * 100
    assert not (r2 / "model.onnx").exists() and stuck.exists()
    assert sorted(files_of(state / "runs" / "r3")) == ["model.onnx", "run.json"]
    records = {r["id"]: r for r in RunStore(str(state)).load_all()}
    assert records["r1"]["pruned"] and "pruned" not in records["r2"]   # r2: tried again next time
    assert "removed 1 run(s)" in result.stdout, result.stdout


def test_prune_needs_a_number_to_keep(tmp_path):
    result = prune(site_file(tmp_path, tmp_path / "state"))
    assert result.returncode == 2 and "retention.keep_runs" in result.stderr, result.stderr
    result = prune(site_file(tmp_path, tmp_path / "state"), "--keep", "-1")
    assert result.returncode == 2 and "--keep" in result.stderr, result.stderr


def test_prune_of_a_directory_that_is_no_state_directory_says_so_and_makes_nothing(tmp_path):
    """A state_dir mistyped (--set state_dir=/var/lib/edgefl/agregator) or the wrong site
    file: prune made the directory and its lock file there and said "removed 0 run(s)",
    exit 0, while the runs it was meant to remove filled the disk elsewhere. Refused,
    naming the directory and where its name came from; nothing is made."""
    missing = tmp_path / "agregator"
    for dry in ([], ["--dry-run"]):
        result = prune(site_file(tmp_path, missing), "--keep", "1", *dry)
        assert result.returncode == 1, result.stdout + result.stderr
        assert f"edgefl prune: error: {missing}: no such directory (state_dir, " \
            f"{tmp_path / 'aggregator.yaml'}" in result.stderr, result.stderr
        assert not missing.exists()
    # a directory, but no aggregator service's: no runs/ in it
    other = tmp_path / "client-1"
    other.mkdir()
    (other / "client.npz").write_bytes(b"x")
    result = prune(site_file(tmp_path, other), "--keep", "1")
    assert result.returncode == 1
    assert f"{other}: holds no runs/ directory, so no aggregator service has kept runs " \
        "there" in result.stderr, result.stderr
    assert sorted(os.listdir(other)) == ["client.npz"]
    # a file
    (tmp_path / "afile").write_text("")
    result = prune(site_file(tmp_path, tmp_path / "afile"), "--keep", "1")
    assert result.returncode == 1 and f"{tmp_path / 'afile'}: not a directory" in \
        result.stderr, result.stderr


def test_prune_refuses_a_state_directory_the_service_holds_and_removes_nothing(tmp_path):
    from edgefl.roles.state import hold_state_dir

    state = tmp_path / "state"
    _ended_run(state, "r1", 1, {"model.onnx": b"a" * 10})
    before = files_of(state / "runs")
    site = site_file(tmp_path, state)
    with hold_state_dir(state, "aggregator"):                # as the running service does
        result = prune(site, "--keep", "0")
        dry = prune(site, "--keep", "0", "--dry-run")
    assert result.returncode == 1 and \
        f"in use by the aggregator service (process {os.getpid()})" in result.stderr
    assert "retention.keep_runs" in result.stderr, result.stderr
    assert dry.returncode == 0 and "would remove 1 run(s), 10 bytes" in dry.stdout
    assert files_of(state / "runs") == before


# ---------------------------------------------------------------------------------------
# the prune command: the running service prunes (`edgefl ctl prune`)
# ---------------------------------------------------------------------------------------

def retained_record(f, run_id) -> dict | None:
    """The retained run record on runs/<run_id>, as a subscriber gets it."""
    from brokers import messages_within

    t = f.transport("operator")
    t.connect()
    try:
        t.subscribe(f.topics.run_record(run_id), qos=1)
        got = [json.loads(m.payload) for m in messages_within(t, 0.5) if m.payload]
    finally:
        t.close(timeout=1.0, announce_offline=False)
    return got[-1] if got else None


def spared(files: dict, run_id: str) -> dict:
    """The files of run_id but its record."""
    return {k: v for k, v in under(files, run_id).items()
            if not k.endswith(f"{os.sep}run.json")}


def test_ctl_prune_while_the_service_waits_removes_the_older_runs_files(fleet):
    """Two finished runs, the service waiting for the next: the command's dry run names the
    older run and its bytes and removes nothing; the prune removes its files and keeps its
    record, marked pruned in the listing, on disk and on the runs topic; the newer run is
    whole. `keep` defaults to the site file's retention.keep_runs."""
    f = fleet(keep_runs=2)
    f.start_all()
    for run_id in ("r1", "r2"):
        f.run_to_end(run_config(rounds=1), run_id)
    before = files_of(f.state_dir)
    doomed = spared(before, "r1")
    total = sum(size for size, _ in doomed.values())

    default = f.ok({"cmd": "prune", "dry_run": True})              # keep_runs 2: nothing
    assert (default["keep"], default["runs"], default["bytes"]) == (2, [], 0), default
    dry = f.ok({"cmd": "prune", "keep": 1, "dry_run": True})
    assert files_of(f.state_dir) == before                         # nothing removed
    assert dry["dry_run"] is True and dry["keep"] == 1 and dry["bytes"] == total, dry
    assert [(r["run"], r["state"], r["files"], r["bytes"], r["errors"]) for r in dry["runs"]] \
        == [("r1", "finished", len(doomed), total, [])], dry
    assert dry["runs_root"] == str(f.state_dir / "runs")

    done = f.ok({"cmd": "prune", "keep": 1})
    assert done["dry_run"] is False and done["bytes"] == total, done
    assert [(r["run"], r["bytes"], r["errors"]) for r in done["runs"]] == [("r1", total, [])]
    after = files_of(f.state_dir)
    assert list(under(after, "r1")) == [os.path.join("runs", "r1", "run.json")]
    assert under(after, "r2") == under(before, "r2")
    runs = {r["id"]: r for r in f.ok({"cmd": "runs"})["runs"]}
    assert runs["r1"]["state"] == "finished" and runs["r1"]["pruned_bytes"] == total
    assert runs["r1"]["final_accuracy"] is not None and "pruned" not in runs["r2"]
    on_disk = {r["id"]: r for r in RunStore(str(f.state_dir)).load_all()}
    assert on_disk["r1"]["pruned"] and on_disk["r1"]["pruned_bytes"] == total
    retained = retained_record(f, "r1")
    assert retained["pruned_bytes"] == total and retained["state"] == "finished", retained
    assert f.ok({"cmd": "prune", "keep": 1})["runs"] == []       # nothing left to do


def test_ctl_prune_leaves_the_running_paused_queued_and_site_file_runs(fleet, tmp_path):
    site = tmp_path / "site-run.yaml"
    site.write_text(json.dumps(run_config(rounds=1)))              # JSON is YAML
    site_out = tmp_path / "site-out"
    f = fleet(site_run=(str(site), str(site_out)))
    f.start_all()
    site_id = f.daemon.site_record["id"]
    wait_state(f, site_id, "finished")
    f.run_to_end(run_config(rounds=1), "r1")
    f.ok({"cmd": "start", "config": run_config(rounds=500), "run": "r2"})
    f.events.wait("round_closed", run="r2", round=1)

    def site_files():
        # the site file's run: its checkpoint directly in the state directory, its outputs
        # in its own directory, its record under runs/
        files = files_of(f.state_dir)
        return ({k: v for k, v in files.items() if not k.startswith(f"runs{os.sep}")},
                under(files, site_id), files_of(site_out))

    site_before = site_files()
    assert site_before[0] and site_before[2]
    running = f.ok({"cmd": "prune", "keep": 0})                    # r2 running
    assert [r["run"] for r in running["runs"]] == ["r1"], running
    assert [s["run"] for s in running["skipped"]] == [site_id], running
    assert "the site file's run" in running["skipped"][0]["why"]
    assert site_files() == site_before
    assert AggregatorCheckpoint.load(f.state_dir / "runs" / "r2" / "state") is not None

    f.ok({"cmd": "pause"})
    f.ok({"cmd": "start", "config": run_config(rounds=1), "run": "r3"})   # queued behind
    before = files_of(f.state_dir)
    paused = f.ok({"cmd": "prune", "keep": 0})
    assert paused["runs"] == [] and [s["run"] for s in paused["skipped"]] == [site_id]
    after = files_of(f.state_dir)
    assert set(under(before, "r2")) <= set(under(after, "r2"))    # nothing of r2 removed
    assert under(after, "r3") == under(before, "r3") and site_files() == site_before
    records = {r["id"]: r for r in RunStore(str(f.state_dir)).load_all()}
    assert records["r1"]["pruned"] and (records["r2"]["state"], records["r3"]["state"]) == \
        ("paused", "queued")
    assert not any(records[r].get("pruned") for r in (site_id, "r2", "r3"))
    f.ok({"cmd": "resume"})
    f.ok({"cmd": "stop"})


def test_ctl_prune_refuses_bad_values_naming_them_and_removes_nothing(fleet):
    f = fleet()                                          # no retention.keep_runs
    f.start_all()
    for run_id in ("r1", "r2"):
        f.run_to_end(run_config(rounds=1), run_id)
    before = files_of(f.state_dir)
    cases = [
        ({}, "prune: give keep (how many of the most recently ended runs keep their files): "
             "the service's site file sets no retention.keep_runs"),
        ({"keep": None}, "prune: give keep"),
        ({"keep": True}, "prune: keep: must be an integer, got True"),
        ({"keep": -1}, "prune: keep: -1 is below the minimum 0"),
        ({"keep": 1.5}, "prune: keep: must be an integer, got 1.5"),
        ({"keep": "1"}, "prune: keep: must be an integer, got '1'"),
        ({"keep": 1, "dry_run": "no"}, "prune: dry_run: must be true or false, got 'no'"),
        ({"keep": 1, "dry_run": 0}, "prune: dry_run: must be true or false, got 0"),
        ({"keep": 1, "run": "r1"}, "prune: unknown field 'run'"),
    ]
    for fields, error in cases:
        reply = f.control().request({"cmd": "prune", **fields}, timeout=20)
        assert reply["ok"] is False and reply["cmd"] == "prune", (fields, reply)
        assert reply["error"].startswith(error), (fields, reply["error"])
    assert files_of(f.state_dir) == before
    assert not any(r.get("pruned") for r in RunStore(str(f.state_dir)).load_all())


def test_a_record_whose_id_is_not_one_directory_under_runs_is_never_pruned(tmp_path):
    """Defence in depth below the id check: a record whose id resolves to the runs
    directory itself or above it (empty, `.`, `..`, `a/..`: from a store written by hand or
    by a version without the check) is left, and nothing outside its own directory goes."""
    from edgefl.roles.retention import prune_runs

    root = tmp_path / "state" / "runs"
    for run in ("r1", "r2"):
        (root / run).mkdir(parents=True)
        (root / run / "model.npz").write_bytes(b"x" * 10)
        (root / run / "run.json").write_text("{}")
    (tmp_path / "state" / "aggregator.lock").write_text("1")
    before = files_of(tmp_path / "state")
    records = [{"id": bad, "state": "finished", "ended": 10.0 + i}
               for i, bad in enumerate(("", ".", "..", "r1/..", "r1/../r2"))]
    records.append({"id": "r2", "state": "paused"})
    report = prune_runs(records, 0, str(root), spare=("run.json",))
    assert files_of(tmp_path / "state") == before
    assert report.runs == []
    assert sorted(why.split(":")[0] for _, why in report.skipped) == \
        ["its id is not one directory name under " + str(root)] * 5, report.skipped


def test_a_prune_reply_lists_a_bounded_number_of_runs_with_the_totals(tmp_path):
    """The service's reply to `prune` is one MQTT message: a prune of thousands of runs
    lists the first ones only (every run with a failed removal among them), says how many
    it leaves out, and keeps the totals and the exit status of the whole prune."""
    from edgefl.cli.prune import prune_lines, prune_status
    from edgefl.roles.retention import PruneReport, RunPrune

    report = PruneReport(0, False, str(tmp_path))
    for i in range(6):
        run = RunPrune(f"r{i}", "finished", float(i))
        run.removed.append((str(tmp_path / f"r{i}" / "model.npz"), 10))
        if i == 4:
            run.errors.append((str(tmp_path / "r4" / "model.npz"), "Permission denied"))
        report.runs.append(run)
    report.skipped += [(f"s{i}", "the site file's run") for i in range(5)]
    doc = report.as_dict(limit=2)
    assert [r["run"] for r in doc["runs"]] == ["r4", "r0"]
    assert [s["run"] for s in doc["skipped"]] == ["s0", "s1"]
    assert (doc["runs_total"], doc["runs_failed"], doc["skipped_total"], doc["bytes"]) == \
        (6, 1, 5, 60)
    assert len(json.dumps(report.as_dict(limit=2))) < len(json.dumps(report.as_dict()))
    out, err = prune_lines(doc, "edgefl ctl prune")
    assert out[-2:] == ["... and 4 more run(s), not listed",
                        "removed 5 run(s), 60 bytes; 1 path(s) could not be removed"], out
    assert err[-1] == "edgefl ctl prune: ... and 3 more run(s) left, not listed", err
    assert prune_status(doc) == 1
    # unbounded (edgefl prune, on this machine): everything, the same totals
    whole = report.as_dict()
    assert len(whole["runs"]) == 6 and prune_lines(whole, "edgefl prune")[0][-1] == out[-1]


def _finished_runs(root, n: int) -> list:
    """The records of n finished runs r0..r{n-1} (r0 the oldest), each with a model.npz
    under root/<id>/."""
    records = []
    for i in range(n):
        (root / f"r{i}").mkdir(parents=True)
        (root / f"r{i}" / "model.npz").write_bytes(b"x")
        records.append({"id": f"r{i}", "state": "finished", "ended": float(i)})
    return records


def test_a_run_queued_during_a_prune_keeps_the_model_it_starts_from(tmp_path):
    """The service prunes at a run's end on its run thread while its control thread takes
    `start`s: a run queued meanwhile, starting from a run the prune has not reached yet,
    keeps that run's files (the waiting runs are read again before each run is pruned)."""
    from edgefl.roles.retention import prune_runs

    root = tmp_path / "runs"
    records = _finished_runs(root, 3)
    queued = {"id": "q", "state": "queued",
              "config": run_config(rounds=1, model={"name": "softmax",
                                                    "init": str(root / "r1")})}

    def mark(record, run):
        record["pruned"] = 1.0
        if record["id"] == "r0":
            records.append(queued)          # `ctl start` on the other thread, just now

    report = prune_runs(records, 0, str(root), spare=(), mark=mark,
                        current=lambda: list(records))
    assert [r.run for r in report.runs] == ["r0", "r2"]
    assert report.skipped == [("r1", f"run q (queued) starts from its model (model.init "
                                     f"{root / 'r1'})")]
    assert (root / "r1" / "model.npz").exists()


def test_prune_holds_its_lock_for_one_run_at_a_time(tmp_path):
    """The service prunes under its export lock (an export must not read a checkpoint
    half removed), but one run at a time: a run ending meanwhile waits for one run's
    removal, not for a prune of thousands. The lock is free between runs, each run is
    removed while it is held, and a run another prune pruned meanwhile is passed over."""
    import threading

    from edgefl.roles.retention import prune_runs

    root = tmp_path / "runs"
    records = _finished_runs(root, 4)

    class Watched:
        def __init__(self):
            self.lock, self.held, self.times = threading.Lock(), [], 0

        def __enter__(self):
            assert self.lock.acquire(blocking=False), "taken while held"
            self.times += 1

        def __exit__(self, *exc):
            self.lock.release()

    lock = Watched()

    def mark(record, run):
        assert lock.lock.locked(), f"{record['id']} removed without the lock"
        lock.held.append(record["id"])
        if record["id"] == "r0":
            records[1]["pruned"] = 1.0       # as another prune would, between two runs
        record["pruned"] = 1.0

    report = prune_runs(records, 1, str(root), spare=(), mark=mark, lock=lock)
    assert lock.times == 3 and not lock.lock.locked()
    assert lock.held == ["r0", "r2"] == [r.run for r in report.runs]


def test_ctl_prune_leaves_the_run_whose_end_is_still_being_recorded(tmp_path):
    """A run stopped by the operator is `stopped` before its model is exported from its
    checkpoint (under the export lock, which prune waits for): a prune that came in between
    would remove that checkpoint before the export. The run the service is still closing is
    left, with the reason, and counted among the ended runs kept."""
    from edgefl.roles.control import Command
    from edgefl.roles.daemon import Daemon, DaemonSettings

    state = tmp_path / "state"
    _ended_run(state, "r1", 1, {"model.onnx": b"a" * 10})
    r2 = _ended_run(state, "r2", 2, {"state/aggregator.npz": b"b" * 20})
    daemon = Daemon(DaemonSettings(), str(state), transport_factory=None)
    daemon.records = {r["id"]: r for r in daemon.store.load_all()}
    daemon.records["r2"]["state"] = "stopped"
    daemon._closing = "r2"              # as _execute has it until the run's end is recorded
    result = daemon._cmd_prune(Command("prune", {"keep": 0}))
    assert [r["run"] for r in result["runs"]] == ["r1"], result
    assert [s["run"] for s in result["skipped"]] == ["r2"], result
    assert "still being written" in result["skipped"][0]["why"]
    assert (r2 / "state" / "aggregator.npz").read_bytes() == b"b" * 20
    daemon._closing = None              # recorded: the next prune may take it
    assert [r["run"] for r in daemon._cmd_prune(Command("prune", {"keep": 0}))["runs"]] == \
        ["r2"]


def test_edgefl_ctl_prune_prints_what_it_removed_and_exits_1_on_a_failed_removal(
        fleet, tmp_path):
    f = fleet()
    f.start_all()
    for run_id in ("r1", "r2", "r3"):
        f.run_to_end(run_config(rounds=1), run_id)
    ctl = orchestration.ctl_argv(f, tmp_path)
    root = f.state_dir / "runs"
    before = files_of(f.state_dir)
    sizes = {r: sum(s for s, _ in spared(before, r).values()) for r in ("r1", "r2")}

    dry = orchestration.run_ctl(ctl, "prune", "--keep", "1", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert lines[0] == f"{root}: keeping the files of the 1 most recently ended run(s)", lines
    assert lines[1].startswith("would remove run r1 (finished ") and lines[1].endswith(
        f"): {len(spared(before, 'r1'))} file(s), {sizes['r1']} bytes"), lines
    assert lines[2].startswith("would remove run r2 (finished "), lines
    assert lines[3] == (f"would remove 2 run(s), {sizes['r1'] + sizes['r2']} bytes "
                        "(dry run: nothing removed)"), lines
    assert files_of(f.state_dir) == before

    stuck = root / "r1" / "state" / "rounds.jsonl"
    assert stuck.is_file()
    if not _immutable(stuck):
        pytest.skip("cannot make a file unremovable here (chattr +i refused)")
    try:
        failed = orchestration.run_ctl(ctl, "prune", "--keep", "1")
    finally:
        _mutable(stuck)
    assert failed.returncode == 1, (failed.stdout, failed.stderr)
    assert f"edgefl ctl prune: cannot remove {stuck}: " in failed.stderr, failed.stderr
    assert "removed run r2 " in failed.stdout and "removed 1 run(s), " in failed.stdout
    assert "; 1 path(s) could not be removed" in failed.stdout, failed.stdout
    assert stuck.exists() and not (root / "r1" / "model.onnx").exists()

    again = orchestration.run_ctl(ctl, "prune", "--keep", "1", "--json")   # r1 tried again
    assert again.returncode == 0, again.stderr
    reply = json.loads(again.stdout)
    assert reply["ok"] and [r["run"] for r in reply["result"]["runs"]] == ["r1"], reply
    assert list(under(files_of(f.state_dir), "r1")) == [os.path.join("runs", "r1", "run.json")]
    assert spared(files_of(f.state_dir), "r3") == spared(before, "r3")


@pytest.mark.parametrize("argv, problem", [
    (["stop", "--dry-run"], "ctl stop: --dry-run is for prune"),
    (["pause", "--keep", "1"], "ctl pause: --keep is for prune"),
    (["prune", "--run", "r1"], "ctl prune: takes no --run"),
    # status answered with the active run's, runs with every run: a --run asking about
    # another (a stopped one, one of another federation) was dropped without a word
    (["status", "--run", "r1"], "ctl status: takes no --run (it reports the service and its "
                                "active run; `edgefl ctl runs` lists every run with its state)"),
    (["runs", "--run", "r1"], "ctl runs: takes no --run (it lists every run"),
])
def test_ctl_refuses_prune_options_elsewhere_before_sending(capsys, argv, problem):
    from edgefl.cli import main

    assert main(["ctl", *argv, "--broker", "mqtt://127.0.0.1:1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"edgefl ctl: error: {problem}"), err


def test_prune_leaves_a_run_whose_model_a_waiting_run_reads_through_a_linked_file(tmp_path):
    """model.init may name a directory of the user's whose model.npz is a link into an
    ended run: prepare reads the file the link points to, so that run is left too."""
    state = tmp_path / "state"
    ended = {run_id: _ended_run(state, run_id, seq, {"model.npz": run_id.encode() * 100})
             for seq, run_id in enumerate(("a", "b"), 1)}
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.npz").symlink_to(ended["a"] / "model.npz")
    run_dir = state / "runs" / "q"
    (run_dir / "state").mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({
        "id": "q", "seq": 3, "state": "queued", "site": None, "created": 3000.0,
        "config": run_config(rounds=1, model={"name": "softmax", "init": str(mine)}),
        "run_dir": str(run_dir), "state_dir": str(run_dir / "state"),
        "out_dir": str(run_dir)}))
    site = site_file(tmp_path, state)
    before = files_of(state)
    done = prune(site, "--keep", "0")
    assert done.returncode == 0, done.stderr
    after = files_of(state)
    assert under(after, "a") == under(before, "a"), done.stderr
    assert list(under(after, "b")) == [os.path.join("runs", "b", "run.json")]
    assert re.search(r"run a left: run q \(queued\) starts from its model", done.stderr)


def test_prune_leaves_the_runs_a_waiting_run_starts_from(tmp_path):
    """A queued, running or paused run whose model.init names an ended run's directory or
    its model.npz needs that file to start (or resume, before it has recorded it): the run
    is left, reported with the run that names it, and goes once that run has ended."""
    state = tmp_path / "state"
    ended = {run_id: _ended_run(state, run_id, seq, {"model.npz": run_id.encode() * 100})
             for seq, run_id in enumerate(("a", "b", "c", "d"), 1)}

    def waiting(run_id, seq, run_state, init):
        run_dir = state / "runs" / run_id
        (run_dir / "state").mkdir(parents=True)
        record = {"id": run_id, "seq": seq, "state": run_state, "site": None,
                  "config": run_config(rounds=1, model={"name": "softmax", "init": init}),
                  "created": 3000.0 + seq, "run_dir": str(run_dir),
                  "state_dir": str(run_dir / "state"), "out_dir": str(run_dir)}
        (run_dir / "run.json").write_text(json.dumps(record))

    waiting("q", 5, "queued", str(ended["a"]))                    # the run's directory
    waiting("p", 6, "paused", str(ended["b"] / "model.npz"))      # its model.npz
    (tmp_path / "link").symlink_to(ended["c"])                    # through a link
    waiting("r", 7, "running", str(tmp_path / "link"))
    site = site_file(tmp_path, state)
    before = files_of(state)

    done = prune(site, "--keep", "0")
    assert done.returncode == 0, done.stderr
    after = files_of(state)
    assert list(under(after, "d")) == [os.path.join("runs", "d", "run.json")]
    for run_id, by in (("a", "q"), ("b", "p"), ("c", "r")):
        assert under(after, run_id) == under(before, run_id)
        assert re.search(rf"run {run_id} left: run {by} \(\w+\) starts from its model "
                         rf"\(model\.init ", done.stderr), done.stderr

    for run_id in ("q", "p", "r"):                # they end: their sources may go
        path = state / "runs" / run_id / "run.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "state": "finished",
                                    "ended": 4000.0}))
    again = prune(site, "--keep", "3")
    assert again.returncode == 0, again.stderr
    for run_id in ("a", "b", "c"):
        assert list(under(files_of(state), run_id)) == [
            os.path.join("runs", run_id, "run.json")]
