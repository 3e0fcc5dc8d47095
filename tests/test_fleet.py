"""`edgefl fleet up / status / down` (edgefl.fleet): real processes on a real broker.

Each test runs the commands as a user would, in a temporary directory: `fleet up` starts
Mosquitto with the generated accounts (or, with EDGEFL_MOSQUITTO=none, the embedded broker),
the aggregator service and the client services; the command it prints next starts a digits
run, which must finish; `fleet status` shows the nodes; `fleet down` stops every process
and keeps the files. docs/examples/fleet/ must be what `fleet up` writes.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import usage_error, wait_for  # noqa: E402
from edgefl import fleet as fleet_module  # noqa: E402
from edgefl.cli import main  # noqa: E402
from edgefl.service.accounts import find_dynsec_plugin  # noqa: E402
from edgefl.transport.broker import adapt_mosquitto_conf, find_mosquitto, have_python_broker  # noqa: E402,E501

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "docs" / "examples" / "fleet"
EDGEFL = [sys.executable, "-m", "edgefl.cli"]


def edgefl(cwd, *args, env=None, timeout=300):
    return subprocess.run(EDGEFL + list(args), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def _next_command(stdout: str) -> list:
    line = next(l for l in stdout.splitlines() if l.startswith("next: "))
    argv = shlex.split(line[len("next: "):])
    assert argv[:2] == ["edgefl", "ctl"], line
    return EDGEFL + argv[1:]


def _pids(directory: Path) -> dict:
    doc = json.loads((directory / "fleet.json").read_text())
    return {name: p["pid"] for name, p in doc["processes"].items()}


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _run_digits(cwd: Path, start: list, env=None) -> str:
    """Start the fleet's digits run with the printed command and follow it with `ctl watch`
    (started first, so it cannot miss the run); returns watch's output."""
    watch_cmd = [a if a != "start" else "watch" for a in start if not a.endswith("digits.yaml")]
    watch = subprocess.Popen(watch_cmd + ["--run", "digits-1"], cwd=cwd, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = watch.stdout.readline()       # the status reply: watch is subscribed
        assert "aggregator" in first, first
        started = subprocess.run(start + ["--run", "digits-1"], cwd=cwd, env=env,
                                 capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stdout + started.stderr
        assert "run digits-1: state queued" in started.stdout
        out, _ = watch.communicate(timeout=240)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    assert watch.returncode == 0, first + out
    assert "digits-1 run_finished: rounds 5" in out, first + out
    return out


def _bring_up_run_and_stop(tmp_path: Path, clients: int, env=None) -> str:
    up = edgefl(tmp_path, "fleet", "up", "--clients", str(clients), "--dir", "fleet", env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    fleet_dir = tmp_path / "fleet"
    ids = [f"client-{i}" for i in range(1, clients + 1)]
    assert f"aggregator and {clients} clients ({', '.join(ids)}) online" in up.stdout
    pids = _pids(fleet_dir)
    assert sorted(pids) == sorted(["broker", "aggregator", *ids])
    try:
        watched = _run_digits(tmp_path, _next_command(up.stdout), env=env)
        assert len(re.findall(r"round \d closed \(all\): %d update" % clients, watched)) == 5
        summary = fleet_dir / "state" / "aggregator" / "runs" / "digits-1" / "summary.json"
        assert json.loads(summary.read_text())["rounds"] == 5
        # watching a run that has ended says how it ended, and returns
        start = _next_command(up.stdout)
        late = subprocess.run([a if a != "start" else "watch" for a in start
                               if not a.endswith("digits.yaml")] + ["--run", "digits-1"],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert late.returncode == 0, late.stdout + late.stderr
        assert re.search(r"^run digits-1: finished .*, 5/5 rounds", late.stdout, re.M), \
            late.stdout

        status = edgefl(tmp_path, "fleet", "status", "--dir", "fleet", env=env)
        assert status.returncode == 0, status.stdout + status.stderr
        for name in pids:
            assert re.search(rf"^{name}\s+{pids[name]}\s+running$", status.stdout, re.M)
        for node in ids:        # each trained the run's 5 rounds
            assert re.search(rf"^{node}\s+client\s+yes\s+\S+\s+\S+\s+5$", status.stdout, re.M)
        assert f"{clients + 1} nodes: {clients + 1} online, 0 offline" in status.stdout

        if env is None:     # Mosquitto: `edgefl status` with a node's bound account
            bound = edgefl(tmp_path, "status", "--config", "fleet/aggregator.yaml")
            assert bound.returncode == 1
            assert "account 'aggregator' may be bound" in bound.stderr
            as_operator = edgefl(tmp_path, "status", "--config", "fleet/aggregator.yaml",
                                 "--username", "operator", "--password-file",
                                 "fleet/credentials/operator.pw")
            assert as_operator.returncode == 0, as_operator.stderr
            assert f"{clients + 1} nodes: {clients + 1} online" in as_operator.stdout

        again = edgefl(tmp_path, "fleet", "up", "--dir", "fleet", env=env)
        assert again.returncode == 1
        assert "a fleet is already running in" in again.stderr
        assert f"broker pid {pids['broker']}" in again.stderr
        assert _pids(fleet_dir) == pids          # the refusal changed nothing
    finally:
        down = edgefl(tmp_path, "fleet", "down", "--dir", "fleet", env=env)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "fleet down: stopped" in down.stdout
    assert all(_gone(pid) for pid in pids.values())
    for kept in ["aggregator.yaml", *(f"{c}.yaml" for c in ids), "digits.yaml", "long.yaml",
                 "credentials/operator.pw", "logs/aggregator.log", "logs/client-1.log",
                 "state/aggregator/runs/digits-1/model.onnx"]:
        assert (fleet_dir / kept).exists(), kept
    # each service stopped on SIGTERM as under systemd, not killed
    assert "edgefl aggregator: stopped (SIGTERM)" in (fleet_dir / "logs/aggregator.log").read_text()
    assert "killed" not in down.stdout
    nothing = edgefl(tmp_path, "fleet", "down", "--dir", "fleet", env=env)
    assert nothing.returncode == 0 and "nothing is running in fleet" in nothing.stdout
    return up.stdout


def test_a_fleet_on_mosquitto_runs_a_run_and_stops(tmp_path):
    if find_mosquitto() is None or find_dynsec_plugin() is None:
        pytest.skip("needs mosquitto >= 2.0 with its dynamic security plugin (apt-get "
                    "install mosquitto)")
    out = _bring_up_run_and_stop(tmp_path, clients=3)
    assert "broker (mosquitto, accounts bound to client ids)" in out
    log = (tmp_path / "fleet" / "logs" / "broker.log").read_text()
    assert "closing old connection" not in log         # every connection had its own id
    assert "u'aggregator-ctl'" in log                  # the control connection's own account
    # a stopped fleet starts again as it was, and refuses to become another one
    other = edgefl(tmp_path, "fleet", "up", "--dir", "fleet", "--clients", "2")
    assert other.returncode == 1 and "holds a fleet with --clients 3" in other.stderr


def test_a_fleet_without_mosquitto_uses_the_embedded_broker(tmp_path):
    if not have_python_broker():
        pytest.skip("the embedded pure-Python broker is not installed (pip install "
                    "'edgefl[broker]')")
    env = dict(os.environ, EDGEFL_MOSQUITTO="none")     # as if Mosquitto were not installed
    out = _bring_up_run_and_stop(tmp_path, clients=2, env=env)
    assert "Mosquitto is not installed: the embedded broker" in out
    assert "--mqtt 3.1.1" in out                        # amqtt speaks MQTT 3.1.1 only
    assert "edgefl broker: python listening" in \
        (tmp_path / "fleet" / "logs" / "broker.log").read_text()


def test_the_commands_fleet_up_prints_run_as_printed_from_a_directory_with_a_space(
        tmp_path):
    """`fleet up --dir "my fleet"` printed `edgefl ctl start my fleet/digits.yaml --config
    my fleet/aggregator.yaml ...` and `edgefl fleet down --dir my fleet`: pasted into a
    shell, each word a separate argument, the first command named no such file and the
    last no such fleet. Each printed command, run as a shell splits it, does its job."""
    if not (find_mosquitto() and find_dynsec_plugin()) and not have_python_broker():
        pytest.skip("needs Mosquitto or the embedded broker")
    up = edgefl(tmp_path, "fleet", "up", "--clients", "1", "--dir", "my fleet")
    pids = _pids(tmp_path / "my fleet")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        status = subprocess.run(
            [a if a != "start" else "status" for a in _next_command(up.stdout)
             if not a.endswith("digits.yaml")], cwd=tmp_path, capture_output=True,
            text=True, timeout=120)
        assert status.returncode == 0, status.stdout + status.stderr
        assert "aggregator: no active run" in status.stdout, status.stdout
    finally:
        stop = next(line for line in up.stdout.splitlines() if line.startswith("stop it: "))
        down = subprocess.run(EDGEFL + shlex.split(stop[len("stop it: "):])[1:], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        if down.returncode != 0 or "fleet down: stopped" not in down.stdout:
            edgefl(tmp_path, "fleet", "down", "--dir", "my fleet")
    assert down.returncode == 0 and "fleet down: stopped" in down.stdout, \
        stop + down.stdout + down.stderr
    assert all(_gone(pid) for pid in pids.values())
    assert "`edgefl fleet up --dir 'my fleet'` starts the same fleet again" in down.stdout


def test_the_shipped_examples_are_what_fleet_up_writes(tmp_path):
    fleet_module.write_examples(str(tmp_path))
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    shipped = sorted(p.relative_to(EXAMPLES) for p in EXAMPLES.rglob("*") if p.is_file())
    assert shipped == written, ("docs/examples/fleet/ is stale; regenerate it: python -c "
                                "\"from edgefl.fleet import write_examples; "
                                "write_examples('docs/examples/fleet')\"")
    for rel in written:
        assert (EXAMPLES / rel).read_text() == (tmp_path / rel).read_text(), rel


def test_fleet_up_writes_the_files_it_shows_in_the_examples(tmp_path):
    """The site files and run configs `fleet up` writes are the examples' but for the port."""
    ids = fleet_module.client_ids(2)
    files = {**fleet_module.site_files("lab", ids, "mqtt://127.0.0.1:40001"),
             **fleet_module.run_configs(2)}
    for name, text in files.items():
        assert text.replace("40001", "1883") == (EXAMPLES / name).read_text(), name


def test_the_fleet_broker_keeps_the_production_global_options():
    """broker/mosquitto.conf's global options (its listeners and paths aside) are in the
    fleet's config with the same values."""
    production = adapt_mosquitto_conf((REPO / "broker" / "mosquitto.conf").read_text(), 1,
                                      "/w")
    fleet = fleet_module.mosquitto_conf(1, "/plugin.so")
    skip = {"listener", "allow_anonymous", "persistence_location", "log_dest", "user"}
    fleet_lines = set(fleet.splitlines())
    for line in production.splitlines():
        if line.split()[0] not in skip:
            assert line in fleet_lines, f"fleet broker config lacks `{line}`"


@pytest.mark.parametrize("args, message", [
    (["up", "--clients", "0"], "1 to 64 clients"),
    (["status"], "no fleet here"),
    (["down"], "no fleet here"),
    (["status", "--clients", "2"], "--clients and --federation are for `up`"),
])
def test_clear_errors(tmp_path, args, message):
    done = edgefl(tmp_path, "fleet", *args, "--dir", "f")
    assert done.returncode != 0
    assert message in done.stderr



@pytest.mark.parametrize("action", ["up", "down"])
@pytest.mark.parametrize("value", ["-1", "0"])
def test_a_timeout_of_zero_or_less_is_refused_naming_the_option(tmp_path, capsys, action,
                                                                  value):
    # up --timeout -1 was accepted (and gave up waiting for the nodes it had started);
    # refused while parsing, nothing is written or started
    fleet_dir = tmp_path / "f"
    assert usage_error(["fleet", action, "--dir", str(fleet_dir), "--timeout", value],
                       capsys) == (f"edgefl fleet: error: argument --timeout: need a number "
                                   f"of seconds > 0, got {value}")
    assert not fleet_dir.exists()

@pytest.mark.parametrize("under", [False, True])
def test_up_refuses_a_dir_that_is_a_file(tmp_path, capsys, under):
    # `--dir some-file` said "[Errno 17] File exists: '...'"; it is a file, say so (and a
    # --dir under a file cannot be made: say that, naming the --dir), writing nothing
    (tmp_path / "some-file").write_text("mine")
    fleet_dir = tmp_path / "some-file" / "sub" if under else tmp_path / "some-file"
    assert main(["fleet", "up", "--dir", str(fleet_dir)]) == 1
    out, err = capsys.readouterr()
    cause = ("cannot make the directory: Not a directory" if under
             else "is a file, not a directory; choose a new or empty directory")
    assert out == "" and err == f"edgefl fleet up: error: --dir {fleet_dir}: {cause}\n"
    assert os.listdir(tmp_path) == ["some-file"]
    assert (tmp_path / "some-file").read_text() == "mine"


def test_up_refuses_a_directory_that_holds_something_else(tmp_path):
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "notes.txt").write_text("mine")
    done = edgefl(tmp_path, "fleet", "up", "--dir", "f")
    assert done.returncode == 1
    assert "directory is not empty and holds no fleet" in done.stderr
    assert sorted(os.listdir(tmp_path / "f")) == ["notes.txt"]


def test_up_waits_for_every_node_and_names_what_failed(tmp_path, monkeypatch):
    """A client that cannot start (its data set is unknown) fails `up` with its log, and
    nothing is left running."""
    if not (find_mosquitto() and find_dynsec_plugin()) and not have_python_broker():
        pytest.skip("no broker")
    real = fleet_module.run_configs

    def broken(n):
        files = real(n)
        files["digits.yaml"] = files["digits.yaml"].replace("name: digits", "name: nosuchset")
        return files

    monkeypatch.setattr(fleet_module, "run_configs", broken)
    with pytest.raises(fleet_module.FleetError, match=r"client-\d exited while the fleet was "
                                                      r"starting[\s\S]*nosuchset"):
        fleet_module.up(str(tmp_path / "f"), clients=1, say=lambda text: None)
    doc = json.loads((tmp_path / "f" / "fleet.json").read_text())
    wait_for(lambda: all(_gone(p["pid"]) for p in doc["processes"].values()), 30,
             "the fleet's processes to be stopped")


def test_a_board_cannot_take_over_the_running_aggregator(tmp_path):
    """Issue 16's attack on a live fleet: mid-run, client-1's account connects under the
    aggregator's client id and under its control connection's (as a clean session, which
    would wipe a persistent one). Both are refused; the run goes on, its control connection
    still answers, and the aggregator never finds its session lost."""
    if find_mosquitto() is None or find_dynsec_plugin() is None:
        pytest.skip("needs mosquitto >= 2.0 with its dynamic security plugin")
    from edgefl.transport.base import TransportError
    from edgefl.transport.mqtt import MqttTransport

    up = edgefl(tmp_path, "fleet", "up", "--clients", "2", "--dir", "fleet")
    assert up.returncode == 0, up.stdout + up.stderr
    fleet_dir = tmp_path / "fleet"
    ctl = _next_command(up.stdout)
    ctl = [a for a in ctl if not a.endswith("digits.yaml")]

    def ctl_run(action, *rest):
        at = ctl.index("start")           # the action and its CONFIG come before the options
        argv = ctl[:at] + [action, *rest] + ctl[at + 1:]
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    try:
        ctl_run("start", str(fleet_dir / "long.yaml"), "--run", "long-1")
        wait_for(lambda: re.search(r"run long-1: running, .*?(\d+) of 1000",
                                   ctl_run("status")), 120, "long-1 to be running")
        url = json.loads((fleet_dir / "fleet.json").read_text())["url"]
        for victim in ("aggregator", "aggregator-ctl"):
            attacker = MqttTransport(url, victim, username="client-1", clean_session=True,
                                     password_file=str(fleet_dir / "credentials/client-1.pw"),
                                     connect_timeout=10)
            with pytest.raises(TransportError, match="Not authorized"):
                attacker.connect()
        status = ctl_run("status")          # the control connection answers
        assert "run long-1: running" in status
        before = int(re.search(r"(\d+) of 1000", status).group(1))
        wait_for(lambda: int(re.search(r"(\d+) of 1000", ctl_run("status")).group(1))
                 > before, 120, "the run to go on after the attempts")
        assert "stopping" in ctl_run("stop")
    finally:
        down = edgefl(tmp_path, "fleet", "down", "--dir", "fleet")
    assert down.returncode == 0
    agg_log = (fleet_dir / "logs" / "aggregator.log").read_text()
    assert "lost our session" not in agg_log
    broker_log = (fleet_dir / "logs" / "broker.log").read_text()
    assert "closing old connection" not in broker_log
    assert broker_log.count("disconnected, not authorised") >= 2


def test_a_new_fleet_whose_port_is_taken_before_the_broker_binds_moves_to_another(
        tmp_path, monkeypatch):
    """free_port() and the broker's bind are two steps; another program may take the port in
    between (seen once under a loaded machine). A new fleet rewrites its files for another
    port and comes up there; nothing is left running on failure either way."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    busy = taken.getsockname()[1]
    ports = iter([busy])
    real_free_port = fleet_module.free_port
    monkeypatch.setattr(fleet_module, "free_port", lambda: next(ports, None) or real_free_port())
    directory = tmp_path / "fleet"
    try:
        fleet = fleet_module.up(str(directory), clients=1, say=lambda text: None)
        try:
            assert fleet.port != busy
            recorded = json.loads((directory / fleet_module.FLEET_RECORD).read_text())
            assert recorded["port"] == fleet.port
            assert f":{fleet.port}" in (directory / "client-1.yaml").read_text()
            assert str(busy) not in (directory / "aggregator.yaml").read_text()
        finally:
            fleet_module.down(str(directory), say=lambda text: None)
    finally:
        taken.close()


def test_a_restarted_fleet_still_says_which_round_each_board_has_installed(tmp_path):
    """After `fleet down` and `fleet up`, each board still has the last run's model.onnx, and
    its status named the sha256 but no longer the round (the dashboard's "model installed"
    lost "round 5 ·"): the retained manifest the board gets again names it."""
    if find_mosquitto() is None or find_dynsec_plugin() is None:
        pytest.skip("needs mosquitto >= 2.0 with its dynamic security plugin (apt-get "
                    "install mosquitto)")
    up = edgefl(tmp_path, "fleet", "up", "--clients", "2", "--dir", "fleet")
    assert up.returncode == 0, up.stdout + up.stderr
    ids = ("client-1", "client-2")

    def installed():
        _, _, statuses = fleet_module.fleet_status(str(tmp_path / "fleet"), wait=1.0)
        return {n: ((statuses or {}).get(n) or {}).get("onnx_round") for n in ids}

    try:
        _run_digits(tmp_path, _next_command(up.stdout))
        wait_for(lambda: installed() == {n: 5 for n in ids}, 60,
                 "both boards reporting the model of round 5 installed")
        down = edgefl(tmp_path, "fleet", "down", "--dir", "fleet")
        assert down.returncode == 0, down.stdout + down.stderr
        again = edgefl(tmp_path, "fleet", "up", "--dir", "fleet")
        assert again.returncode == 0, again.stdout + again.stderr
        wait_for(lambda: installed() == {n: 5 for n in ids}, 60,
                 f"both boards reporting round 5 after the restart (got {installed()})")
    finally:
        edgefl(tmp_path, "fleet", "down", "--dir", "fleet")
