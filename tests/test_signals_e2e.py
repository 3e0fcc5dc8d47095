"""SIGTERM and SIGINT end to end (issue #6 item 3, issue #18 item 6; docs/reliability.md
"Stopping: signals and exit statuses"): real `edgefl aggregator` and `edgefl client`
processes against a real Mosquitto, signalled mid-round (a client while its local round
trains, the aggregator while the round waits for that client, the other clients while they
wait), each stops with exit 0 (the training client before its round's next local step) and
its state persisted, and restarted they finish the run: each round aggregated exactly once,
every round aggregated with all three updates (the round the client abandoned trained once
after the restart, the others' stored updates re-sent rather than retrained), and the final
model is the one the in-process simulation of the same config and seed gives. `edgefl
simulate`, in process and over MQTT, stops inside the round it is in and exits 128 + the
signal.

The aggregator's site file sets the round and export settings the layered config declares
for it (round.deadline, export.every), and every board ends with the final ONNX model.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

import edgefl
from edgefl.roles import AggregatorCheckpoint, ClientProgress
from edgefl.roles.state import JOURNAL_FILE, read_journal
from edgefl.runconfig import load_run_config
from edgefl.sim import simulate
from helpers import NotifySocket, StderrGate, wait_for

pytest_plugins = ["brokers"]

# How long a signalled process may take to exit before the test calls it hung: a bound for
# a broken stop, not a measure of promptness (no timed assertions on a shared machine). That
# a stop is prompt shows in what did not happen: a client's round stopped with fewer steps
# done than planned, a simulation's round left unrecorded.
HANG_S = 120.0
RUN = {
    "dataset": {"name": "digits", "limit_train": 600},
    "partition": {"name": "iid", "clients": 3},
    "model": {"name": "mlp", "hidden": [64]},
    "strategy": {"name": "fedavg"},
    # a local round long enough (0.6-3 s here) to be signalled while it trains, even when a
    # loaded machine is slow to deliver the signal and wake the client's loop; the NumPy
    # backend takes ten times as long per step (5000 epochs: 6.5 s a round, and the test
    # with its in-process reference 3 minutes instead of 30 s)
    "train": {"lr": 0.01, "batch_size": 32, "epochs": 5000 if edgefl.backend == "c" else 500},
    "rounds": 3,
    "clients_per_round": 3,
    "seed": 0,
}


def _role_env() -> dict:
    """The environment of the role processes: this checkout first on the path, and none of
    systemd's variables from whatever runs the tests (a test that wants them sets its own)."""
    env = dict(os.environ)
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        env.pop(key, None)
    return env


def _site_writer(tmp_path: Path, broker_url: str):
    """site(name, doc): writes tmp_path/<name>.yaml, a generic-x86 site file on the test's
    broker with `doc`'s keys added, and returns its path."""
    def site(name: str, doc: dict) -> str:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"profile": "generic-x86", "log": {"level": "info"},
                                        "broker": {"url": broker_url}, **doc}))
        return str(path)
    return site


def test_sigterm_mid_round_stops_cleanly_and_a_restart_resumes(tmp_path, mosquitto_server):
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump(RUN))
    fed = f"sig-{os.urandom(4).hex()}"
    agg_state = tmp_path / "agg-state"
    sockets_dir = Path(tempfile.mkdtemp(prefix="efsig-", dir="/tmp"))
    env = _role_env()
    site = _site_writer(tmp_path, mosquitto_server.url)

    agg_site = site("aggregator", {"node": {"id": "aggregator", "federation": fed},
                                   "state_dir": str(agg_state), "run": str(run_file),
                                   "round": {"deadline": 120.0}, "export": {"every": 2}})
    client_sites = {c: site(f"client-{c}", {"node": {"id": f"client-{c}", "federation": fed},
                                            "state_dir": str(tmp_path / f"client-{c}")})
                    for c in range(3)}
    procs, sockets = [], []

    def spawn(args, name, status: NotifySocket | None = None):
        log = open(tmp_path / f"{name}.log", "ab")
        proc_env = dict(env, NOTIFY_SOCKET=status.path) if status else env
        proc = subprocess.Popen([sys.executable, "-m", "edgefl.cli", *args], cwd=tmp_path,
                                env=proc_env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)
        log.close()
        procs.append(proc)
        return proc

    def aggregator():
        return spawn(["aggregator", "--config", agg_site, "--out", str(tmp_path / "out")],
                     "aggregator")

    def client(c, status=None):
        return spawn(["client", "--config", client_sites[c], "--partition", str(run_file),
                      "--shard", str(c), "--exit-when-finished"], f"client-{c}", status)

    def log_of(name):
        return (tmp_path / f"{name}.log").read_text(errors="replace")

    def stop(proc, name, signalled=False):
        if not signalled:           # one SIGTERM: a second one means "die now" (signals.py)
            proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        try:
            code = proc.wait(HANG_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} did not stop within {HANG_S:g} s of SIGTERM (hung):\n"
                        f"{log_of(name)[-2000:]}")
        assert code == 0, f"{name} exited {code}:\n{log_of(name)[-2000:]}"
        return time.monotonic() - t0

    journal = agg_state / JOURNAL_FILE

    def aggregated():
        return [r["round"] for r in read_journal(journal) if r.get("event") == "aggregated"]

    try:
        status0 = NotifySocket(str(sockets_dir / "client-0"))
        sockets.append(status0)
        agg = aggregator()
        clients = {0: client(0, status0), 1: client(1), 2: client(2)}
        wait_for(lambda: aggregated() == [1], what="round 1 aggregated", timeout=60.0)
        # mid-round 2: client-0 while it trains (systemd's STATUS line says so), and the
        # aggregator while it collects the round's updates
        wait_for(lambda: "STATUS=round 2: training" in status0.lines,
                 what="client-0 training round 2", timeout=60.0)
        clients[0].send_signal(signal.SIGTERM)
        stop(agg, "aggregator")
        stop(clients[0], "client-0", signalled=True)
        done, planned = _abandoned_steps(log_of("client-0"), 2)[-1]
        assert done < planned          # stopped inside the round, before its last step
        assert "STOPPING=1" in status0.lines
        progress = ClientProgress.load(tmp_path / "client-0")
        assert progress.trained == 1 and progress.upload is not None   # round 1's, kept
        assert "stopped (SIGTERM)" in log_of("aggregator")
        assert "round 2 abandoned: stop requested" in log_of("aggregator")
        ckpt = AggregatorCheckpoint.load(agg_state)
        assert ckpt.round == 1 and ckpt.aggregated == [1] and len(ckpt.history) == 1
        assert aggregated() == [1]
        # the others finish round 2's training, store their update, and wait
        wait_for(lambda: all(ClientProgress.load(tmp_path / f"client-{c}").trained == 2
                             for c in (1, 2)), what="clients 1 and 2 to train round 2",
                 timeout=60.0)
        for c in (1, 2):
            stop(clients[c], f"client-{c}")
            progress = ClientProgress.load(tmp_path / f"client-{c}")
            assert progress.trained == 2 and progress.upload is not None
            assert progress.run_id == ckpt.run_id

        # restarted (clients first, so the aggregator finds them online), they finish
        status0.lines.clear()
        clients = {c: client(c, status0 if c == 0 else None) for c in range(3)}
        wait_for(lambda: "STATUS=round 2: training" in status0.lines,
                 what="client-0 to train round 2 again", timeout=60.0)
        agg = aggregator()
        for c, proc in clients.items():
            assert proc.wait(120) == 0, log_of(f"client-{c}")[-3000:]
        wait_for(lambda: (tmp_path / "out" / "summary.json").exists() or agg.poll() is not None,
                 what="the aggregator's outputs", timeout=60.0)
        if agg.poll() is None:      # a service that stays up for the next run: stop it too
            stop(agg, "aggregator")
        assert agg.wait(HANG_S) == 0, log_of("aggregator")[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for s in sockets:
            s.close()
        shutil.rmtree(sockets_dir, ignore_errors=True)

    assert aggregated() == [1, 2, 3]                      # each round exactly once
    assert any(r.get("event") == "resumed" for r in read_journal(journal))
    for c in (1, 2):
        assert "stored update re-sent (not trained twice)" in log_of(f"client-{c}")
    final = AggregatorCheckpoint.load(agg_state)
    assert final.round == 3 and final.aggregated == [1, 2, 3]
    # every round with all three updates: round 2 waited for the client it had lost
    closed = [(r["round"], r["updates"], r["closed_by"]) for r in read_journal(journal)
              if r.get("event") == "aggregated"]
    assert closed == [(1, 3, "all"), (2, 3, "all"), (3, 3, "all")]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    last = [r for r in read_journal(journal) if r.get("event") == "aggregated"][-1]
    assert summary["model_sha256"] == last["model_sha256"]
    # the same final model as `edgefl simulate` in process for the same config and seed
    # (docs/roles.md "Determinism"; the generic-x86 profile sends float32: compression none),
    # signals, abandoned rounds and restarts notwithstanding
    reference = simulate(load_run_config(str(run_file)), None, workers=3, progress=False)
    assert summary["model_sha256"] == reference["model_sha256"]
    # export.every from the site file: rounds 2 and 3 exported; each board installed the last
    assert [e["round"] for e in summary["onnx_exports"]] == [2, 3]
    final_onnx = (tmp_path / "out" / "model.onnx").read_bytes()
    for c in range(3):
        assert (tmp_path / f"client-{c}" / "model.onnx").read_bytes() == final_onnx, c


def _abandoned_steps(log: str, round: int) -> list:
    """[(steps done, steps planned)] of each "round N's training is abandoned after K of M
    local steps" line a stopped client logged."""
    import re

    return [(int(k), int(m)) for k, m in re.findall(
        rf"round {round}'s training is abandoned after (\d+) of (\d+) local steps", log)]


def test_sigterm_while_the_c_core_trains_exits_0_every_time(tmp_path, mosquitto_server):
    """A client stopped while its local round runs in the C core (a GEMM-heavy MLP, the
    interpreter lock released) exits 0, not SIGSEGV. The round stops before its next step
    (the signal's watcher sets the kernel's stop word) and the client joins the training
    thread, so the interpreter exits normally with no thread inside the C core: an exit
    under a running thread ran the C libraries' destructors under it, and OpenBLAS freed
    the buffers its sgemm was using (seen in CI: exit -11). Three stops in a row, each
    mid-round (steps done < steps planned, from the client's log); the client's progress
    file loads and records no round; the aggregator, stopped with SIGINT, exits 0 with its
    checkpoint and journal intact."""
    run = {"dataset": {"name": "digits", "limit_train": 600},
           "partition": {"name": "iid", "clients": 1},
           "model": {"name": "mlp", "hidden": [1024, 1024]},
           "strategy": {"name": "fedavg"},
           # a local round of many seconds: every stop lands inside it
           "train": {"lr": 0.001, "batch_size": 32, "epochs": 400},
           "rounds": 1, "clients_per_round": 1, "seed": 0}
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump(run))
    fed = f"sigc-{os.urandom(4).hex()}"
    sockets_dir = Path(tempfile.mkdtemp(prefix="efsig-", dir="/tmp"))
    env = _role_env()
    site = _site_writer(tmp_path, mosquitto_server.url)

    agg_site = site("aggregator", {"node": {"id": "aggregator", "federation": fed},
                                   "state_dir": str(tmp_path / "agg-state"),
                                   "run": str(run_file), "round": {"deadline": 300.0}})
    client_site = site("client-0", {"node": {"id": "client-0", "federation": fed},
                                    "state_dir": str(tmp_path / "client-0")})
    procs = []
    status = NotifySocket(str(sockets_dir / "client-0"))

    def spawn(args, name, extra_env=None):
        with open(tmp_path / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "edgefl.cli", *args], cwd=tmp_path,
                                    env=dict(env, **(extra_env or {})),
                                    stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    def log_of(name):
        return (tmp_path / f"{name}.log").read_text(errors="replace")

    try:
        agg = spawn(["aggregator", "--config", agg_site], "aggregator")
        for attempt in range(3):
            status.lines.clear()
            client = spawn(["client", "--config", client_site, "--partition", str(run_file),
                            "--shard", "0"], "client-0", {"NOTIFY_SOCKET": status.path})
            wait_for(lambda: "STATUS=round 1: training" in status.lines,
                     what=f"client-0 training round 1 (start {attempt + 1})", timeout=60.0)
            # SIGTERM (systemctl stop), and once SIGINT (Ctrl-C in a terminal): both exit 0
            client.send_signal(signal.SIGINT if attempt == 1 else signal.SIGTERM)
            code = client.wait(HANG_S)
            assert code == 0, f"stop {attempt + 1}: client exited {code}:\n" \
                              f"{log_of('client-0')[-2000:]}"
        stops = _abandoned_steps(log_of("client-0"), 1)
        assert len(stops) == 3 and all(done < planned for done, planned in stops), stops
        assert log_of("client-0").count("edgefl client client-0: stopped; last round "
                                        "trained 0") == 3       # main() returned each time
        assert ClientProgress.load(tmp_path / "client-0").trained == 0   # never finished
        agg.send_signal(signal.SIGINT)
        assert agg.wait(HANG_S) == 0, log_of("aggregator")[-2000:]
        assert "edgefl aggregator: stopped (SIGINT)" in log_of("aggregator")
        ckpt = AggregatorCheckpoint.load(tmp_path / "agg-state")
        assert ckpt.round == 0 and ckpt.aggregated == []
        assert [r["event"] for r in read_journal(tmp_path / "agg-state" / JOURNAL_FILE)
                if r.get("event") == "aggregated"] == []
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        status.close()
        shutil.rmtree(sockets_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# `edgefl simulate` stops mid-round on SIGINT/SIGTERM (issue #18 item 6)
# ---------------------------------------------------------------------------------------

# Rounds of several seconds each: the signal, sent as soon as round 1's progress line is
# out, lands in round 2's local training. A simulation that finished its round before
# stopping (as `--transport mqtt` did) would record round 2 and fail the test.
SIM_RUN = {**RUN, "train": {"lr": 0.01, "batch_size": 32,
                            "epochs": 6000 if edgefl.backend == "c" else 600}}


@pytest.mark.parametrize("transport", ["inproc", "mqtt"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_simulate_stops_within_the_round_it_is_in_and_keeps_the_rounds_done(
        tmp_path, request, transport, signum):
    """A real `edgefl simulate` process (over the test's Mosquitto with --transport mqtt)
    signalled while round 2 trains exits 128 + the signal's number (130, 143) without a
    traceback; round 2 is not recorded; out/ holds round 1: metrics.jsonl (one whole line),
    summary.json saying where it stopped, and model.npz of round 1, which loads and matches
    the summary's hash; no ONNX export."""
    from edgefl.checkpoint import load_checkpoint, model_sha256

    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump(SIM_RUN))
    out = tmp_path / "out"
    # in process on one thread: the main thread itself is inside the C core when the signal
    # comes (only the signal's watcher thread can reach it), and round 1's line is printed
    # as round 1 ends (with more threads its evaluation, and so its line, overlaps round 2)
    args = ["simulate", str(run_file), "--out", str(out), "--workers",
            "1" if transport == "inproc" else "2"]
    if transport == "mqtt":
        broker = request.getfixturevalue("mosquitto_server")
        args += ["--transport", "mqtt", "--broker", broker.url]
    log_path = tmp_path / "simulate.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "edgefl.cli", *args], cwd=tmp_path,
                                env=_role_env(), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)

    def log_text():
        return log_path.read_text(errors="replace")

    try:
        wait_for(lambda: "round 1/3" in log_text() or proc.poll() is not None,
                 what="round 1's progress line", timeout=180.0)
        assert proc.poll() is None, log_text()
        proc.send_signal(signum)
        code = proc.wait(180)      # a bound for a hung process, not a speed requirement
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log_text()
    assert code == 128 + signum, f"exit {code}:\n{text[-3000:]}"
    assert "Traceback" not in text, text[-3000:]
    assert f"stopped ({signum.name}) in round 2 of 3, which is dropped; rounds 1-1 are in " \
        in text, text[-3000:]
    assert "round 2/3" not in text            # round 2 never finished
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == {"reason": "stop_requested", "in_round": 2, "rounds_done": 1,
                                  "rounds_planned": 3,
                                  "message": "stopped in round 2 of 3; 1 round done"}
    assert summary["rounds"] == 1
    ckpt = load_checkpoint(str(out / "model.npz"))
    assert ckpt["round"] == 1 and model_sha256(ckpt["params"]) == summary["model_sha256"]
    assert not (out / "model.onnx").exists() and not (out / "curves.png").exists()


def test_aggregator_site_file_round_client_and_export_settings(tmp_path, capsys):
    """The settings the aggregator reads from its site file (clients, round.*, export.*):
    `edgefl config show` prints them with their file and line; bad values name the file,
    line, key and rule."""
    from edgefl.cli import main
    from edgefl.service.layered import ConfigError, load_service_config

    def site(text):
        path = tmp_path / "aggregator.yaml"
        path.write_text("profile: generic-x86\nnode: {id: agg}\nrun: quickstart\n" + text)
        return str(path)

    path = site('clients: [pi-01, "07", pi-03]\nround:\n  deadline: 45\n  quorum: 0.5\n'
                "  offline_grace: 10\nexport:\n  every: 5\n  quantize: int8\n")
    assert main(["config", "show", "--role", "aggregator", "--site", path, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["values"]["clients"] == ["pi-01", "07", "pi-03"]
    assert doc["values"]["round"] == {"deadline": 45.0, "quorum": 0.5, "min_updates": 1,
                                      "offline_grace": 10.0}
    assert doc["values"]["export"] == {"every": 5, "softmax": True, "quantize": "int8",
                                       "publish": True}
    assert (doc["sources"]["round.quorum"]["file"], doc["sources"]["round.quorum"]["line"]) \
        == (path, 7)
    for text, message in [
            ("clients: [a, b, a]\n", r":4: clients: item 2: 'a' appears twice"),
            ("clients: [pi-01, 7]\n", r":4: clients: item 1: 7 is not an id .*quote numbers"),
            ("clients: [pi/01]\n", r":4: clients: item 0: 'pi/01' contains '/'"),
            ("round: {quorum: 1.5}\n", r":4: round.quorum: 1.5 is above the maximum 1$"),
            ("round: {offline_grace: -1}\n", r":4: round.offline_grace: -1.*minimum 0"),
            ("round: {deadline: 0}\n", r":4: round.deadline: 0 is below the minimum 0.1$"),
            ("round: {min_updates: 0}\n", r":4: round.min_updates: 0 is below the minimum 1$"),
            ("export: {every: -2}\n", r":4: export.every: -2 is below the minimum 0$"),
            ("export: {quantize: int4}\n", r"export.quantize: 'int4' is not valid; valid: "
                                           r"none, int8$"),
            ("export: {publish: sometimes}\n", r"export.publish: must be true or false"),
            ("round: {quorom: 0.5}\n", r"round.quorom: unknown key \(did you mean "
                                       r"round.quorum\?\)")]:
        with pytest.raises(ConfigError, match=message) as exc:
            load_service_config("aggregator", site(text))
        assert str(exc.value).startswith(str(tmp_path / "aggregator.yaml")), str(exc.value)
    # a client may not set them
    with pytest.raises(ConfigError, match=r"round.deadline is not a setting of the client"):
        load_service_config("client", None, profile="rpi4",
                            overrides=["node.id=a", "data.name=digits", "round.deadline=5"])


# ---------------------------------------------------------------------------------------
# the systemd watchdog follows the main loop (sd_notify over a real NOTIFY_SOCKET)
# ---------------------------------------------------------------------------------------

WATCHDOG_S = 4.0    # the WATCHDOG_USEC given: a ping every 2 s while the loop last beat < 2 s ago
PING_S = WATCHDOG_S / 2


def _service_env(notify: NotifySocket) -> dict:
    """The environment systemd gives a Type=notify unit with WatchdogSec= (no WATCHDOG_PID:
    the child's pid is not known before it starts, and an unset one is accepted)."""
    env = dict(os.environ, NOTIFY_SOCKET=notify.path, WATCHDOG_USEC=str(int(WATCHDOG_S * 1e6)))
    for key in ("WATCHDOG_PID", "JOURNAL_STREAM"):
        env.pop(key, None)
    return env


def _pings_after(notify: NotifySocket, t: float) -> int:
    return sum(1 for when in notify.times("WATCHDOG", "1") if when > t)


def _check_watchdog_follows_the_main_loop(proc, notify: NotifySocket, gate: StderrGate,
                                          block, name: str) -> None:
    """Pings while the main loop turns; none once `block()` got the main loop stuck writing a
    log line to its jammed stderr (a stalled journald), while the process and its pinger
    thread live on; pings again once stderr drains."""
    def log():
        return gate.text()[-3000:]

    gate.jam()
    block()
    wait_for(lambda: time.monotonic() - max(notify.times("WATCHDOG", "1")) > 2.5 * PING_S
             or proc.poll() is not None, timeout=60.0, poll=0.1,
             what=f"{name}'s watchdog pings to stop while its main loop is blocked")
    assert proc.poll() is None, f"{name} exited {proc.returncode} instead:\n{log()}"
    silent = len(notify.times("WATCHDOG", "1"))
    time.sleep(PING_S)
    assert len(notify.times("WATCHDOG", "1")) == silent, "a ping while the loop was blocked"
    released = time.monotonic()
    gate.release()
    wait_for(lambda: _pings_after(notify, released) >= 2, timeout=30.0, poll=0.1,
             what=f"{name}'s watchdog pings to resume once its main loop runs again")
    text = gate.text()
    assert "main loop has not run for" in text and "watchdog pings withheld" in text, log()
    assert "main loop running again; watchdog pings resumed" in text, log()


def _stop_and_check(proc, notify: NotifySocket, gate: StderrGate, name: str) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(HANG_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} did not stop within {HANG_S:g} s of SIGTERM (hung):\n"
                    f"{gate.text()[-2000:]}")
    assert code == 0, f"{name} exited {code}:\n{gate.text()[-2000:]}"
    assert notify.find("STOPPING", "1"), notify.lines
    # one READY=1 per process: the aggregator daemon's; its run reports its start in STATUS
    assert len(notify.times("READY", "1")) == 1, notify.lines


def test_aggregator_notifies_systemd_and_its_watchdog_follows_its_main_loop(
        tmp_path, mosquitto_server):
    """The real `edgefl aggregator` under a real NOTIFY_SOCKET with WATCHDOG_USEC: READY=1
    once, STATUS lines (waiting, then the run's rounds), WATCHDOG=1 pings while it waits for
    runs (the idle loop beats) and while a run collects updates, none while its main loop is
    blocked, pings again after, STOPPING=1 and exit 0 on SIGTERM."""
    fed = f"wd-{os.urandom(4).hex()}"
    sockets_dir = Path(tempfile.mkdtemp(prefix="efwd-", dir="/tmp"))
    notify = NotifySocket(str(sockets_dir / "agg"))
    gate = StderrGate()
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump({**RUN, "rounds": 2, "train": {**RUN["train"],
                                                                      "epochs": 1}}))
    site = tmp_path / "aggregator.yaml"
    site.write_text(yaml.safe_dump({
        "profile": "generic-x86", "log": {"level": "info"},
        "broker": {"url": mosquitto_server.url},
        "node": {"id": "aggregator", "federation": fed}, "state_dir": str(tmp_path / "agg")}))
    env = _service_env(notify)
    out = open(tmp_path / "aggregator.out", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "edgefl.cli", "aggregator", "--config",
                             str(site)], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                            stdout=out, stderr=gate.write_fd)
    out.close()
    try:
        ready = wait_for(lambda: notify.find("READY", "1") or proc.poll() is not None,
                         timeout=60.0, what="READY=1 from the aggregator")
        assert proc.poll() is None, gate.text()[-3000:]
        assert ready["STATUS"] == "aggregator: waiting for a run"
        ready_at = notify.times("READY", "1")[0]
        # idle, waiting for runs: its loop beats, so the pings go on long past the 2 s after
        # READY that a loop without beats would get
        wait_for(lambda: _pings_after(notify, ready_at) >= 3, timeout=30.0, poll=0.1,
                 what="watchdog pings while the aggregator waits for runs")
        assert notify.find("STATUS", "aggregator: waiting for a run")

        # a run with no clients: round 1 waits, announced again every second (logging it)
        started = subprocess.run(
            [sys.executable, "-m", "edgefl.cli", "ctl", "--broker", mosquitto_server.url,
             "--federation", fed, "--timeout", "60", "start", str(run_file), "--deadline",
             "1"], env=env, capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stderr
        collecting = wait_for(lambda: notify.times("STATUS", "round 1/2: collecting updates"),
                              timeout=60.0, what="STATUS of round 1")[0]
        assert notify.find("STATUS", "aggregator: run ")       # the run's start, no READY
        wait_for(lambda: _pings_after(notify, collecting) >= 2, timeout=30.0, poll=0.1,
                 what="watchdog pings while the run collects updates")
        _check_watchdog_follows_the_main_loop(proc, notify, gate, lambda: None, "aggregator")
        _stop_and_check(proc, notify, gate, "aggregator")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        notify.close()
        gate.close()
        shutil.rmtree(sockets_dir, ignore_errors=True)


def test_client_watchdog_follows_its_main_loop(tmp_path, mosquitto_server):
    """The real `edgefl client` under a real NOTIFY_SOCKET with WATCHDOG_USEC: READY=1 once
    connected, pings while it waits for a round, none while its main loop is blocked (writing
    the warning about a bad announcement the test publishes to a jammed stderr), pings
    again once stderr drains; STOPPING=1 and exit 0 on SIGTERM."""
    from edgefl.transport.mqtt import MqttTransport
    from edgefl.transport.topics import Topics

    fed = f"wd-{os.urandom(4).hex()}"
    sockets_dir = Path(tempfile.mkdtemp(prefix="efwd-", dir="/tmp"))
    notify = NotifySocket(str(sockets_dir / "client"))
    gate = StderrGate()
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump(RUN))
    site = tmp_path / "client-0.yaml"
    site.write_text(yaml.safe_dump({
        "profile": "generic-x86", "log": {"level": "info"},
        "broker": {"url": mosquitto_server.url},
        "node": {"id": "client-0", "federation": fed}, "state_dir": str(tmp_path / "c0")}))
    out = open(tmp_path / "client.out", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "edgefl.cli", "client", "--config",
                             str(site), "--partition", str(run_file), "--shard", "0"],
                            cwd=tmp_path, env=_service_env(notify), stdin=subprocess.DEVNULL,
                            stdout=out, stderr=gate.write_fd)
    out.close()
    publisher = MqttTransport(mosquitto_server.url, f"wd-test-{os.urandom(3).hex()}")
    try:
        ready = wait_for(lambda: notify.find("READY", "1") or proc.poll() is not None,
                         timeout=60.0, what="READY=1 from the client")
        assert proc.poll() is None, gate.text()[-3000:]
        assert ready["STATUS"] == "client client-0: waiting for a round"
        ready_at = notify.times("READY", "1")[0]
        wait_for(lambda: _pings_after(notify, ready_at) >= 3, timeout=30.0, poll=0.1,
                 what="watchdog pings while the client waits for a round")
        publisher.connect()

        def bad_announcement():
            # not retained: the client's main loop logs "rejected announcement: ..."
            publisher.publish(Topics(fed).round(), b"not an announcement", qos=1)

        _check_watchdog_follows_the_main_loop(proc, notify, gate, bad_announcement, "client")
        assert "client-0: rejected announcement" in gate.text(), gate.text()[-3000:]
        _stop_and_check(proc, notify, gate, "client")
    finally:
        publisher.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        notify.close()
        gate.close()
        shutil.rmtree(sockets_dir, ignore_errors=True)
