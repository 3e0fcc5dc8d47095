"""Running as systemd services (issue #6): sd_notify against a real unix datagram socket,
SIGTERM/SIGINT in a real subprocess, journald logging, the fleet table, the units
(systemd-analyze verify and security where the tool exists) and `edgefl install-service`."""
import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from edgefl.cli import COMMANDS, build_parser, main
from edgefl.service import install as inst
from edgefl.service.layered import ConfigError, load_service_config
from edgefl.service.logs import setup_logging, stream_is_journal
from edgefl.service.notify import Notifier, watchdog_interval
from edgefl.service.signals import install_stop_handlers
from edgefl.service.status import format_fleet
from helpers import usage_error, wait_for

REPO = Path(__file__).resolve().parent.parent
UNITS = REPO / "edgefl" / "service" / "units"
DEVICES = REPO / "devices" / "systemd"
ROLES = ("client", "aggregator", "infer")


# ---------------------------------------------------------------------------------------
# sd_notify
# ---------------------------------------------------------------------------------------

@pytest.fixture
def notify_socket():
    """A bound AF_UNIX datagram socket standing in for systemd: (NOTIFY_SOCKET value, recv)."""
    directory = tempfile.mkdtemp(prefix="edgefl-n")    # short: sun_path holds 108 bytes
    path = os.path.join(directory, "notify")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)

    def recv(timeout=2.0):
        server.settimeout(timeout)
        try:
            return server.recv(4096).decode()
        except socket.timeout:
            return None

    yield path, recv
    server.close()
    shutil.rmtree(directory)


def test_ready_status_stopping_reach_the_socket(notify_socket):
    path, recv = notify_socket
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    assert notifier.ready("client pi-07: waiting for round 1")
    assert recv() == "READY=1\nSTATUS=client pi-07: waiting for round 1"
    assert notifier.status("round 3: training\nsecond line")
    assert recv() == "STATUS=round 3: training second line"   # a newline would start a field
    assert notifier.extend_timeout(90)
    assert recv() == "EXTEND_TIMEOUT_USEC=90000000"
    assert notifier.stopping()
    assert recv() == "STOPPING=1"
    notifier.close()


def test_abstract_namespace_socket():
    name = f"edgefl-test-{os.getpid()}-{time.monotonic_ns()}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind("\0" + name)
    server.settimeout(2)
    try:
        notifier = Notifier("@" + name)
        assert notifier.watchdog()
        assert server.recv(100) == b"WATCHDOG=1"
    finally:
        server.close()


def test_without_notify_socket_everything_is_a_no_op(tmp_path):
    notifier = Notifier.from_environment({})
    assert not notifier.enabled
    assert notifier.ready("x") is False and notifier.status("x") is False
    pinger = notifier.watchdog_pinger(interval=0.01).start()
    assert not pinger.active
    pinger.stop()
    # a socket that is not there: the send fails, is logged, and does not raise
    gone = Notifier(str(tmp_path / "missing"))
    assert gone.ready() is False


def test_watchdog_interval_from_environment():
    pid = str(os.getpid())
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": pid}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "junk"}) is None
    assert watchdog_interval({}) is None


def test_watchdog_pings_at_half_the_timeout_and_stops_cleanly(notify_socket):
    path, recv = notify_socket
    notifier = Notifier(path)
    environ = {"WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid())}
    with notifier.watchdog_pinger(environ=environ) as pinger:
        assert pinger.interval == pytest.approx(0.1)
        assert pinger.active
        start = time.monotonic()
        got = [recv(1.0) for _ in range(4)]
        elapsed = time.monotonic() - start
    assert got == ["WATCHDOG=1"] * 4
    assert 0.25 <= elapsed < 1.0          # first ping at once, then every 0.1 s
    assert not pinger.active
    assert recv(0.3) is None               # nothing after stop()


def test_watchdog_skips_pings_while_unhealthy(notify_socket):
    path, recv = notify_socket
    healthy = {"ok": False}
    pinger = Notifier(path).watchdog_pinger(healthy=lambda: healthy["ok"], interval=0.05)
    with pinger:
        assert recv(0.3) is None           # a stuck main loop: systemd will see silence
        healthy["ok"] = True
        assert recv(1.0) == "WATCHDOG=1"
    assert pinger.pings >= 1


def test_ready_is_sent_once_then_only_the_status(notify_socket):
    # the aggregator daemon is ready, then each run it starts reports its start: one READY=1
    path, recv = notify_socket
    notifier = Notifier(path)
    assert notifier.ready("aggregator: waiting for a run")
    assert recv() == "READY=1\nSTATUS=aggregator: waiting for a run"
    assert notifier.ready("aggregator: run r1, 0 of 3 rounds done")
    assert recv() == "STATUS=aggregator: run r1, 0 of 3 rounds done"
    assert notifier.ready() is False
    assert recv(0.3) is None


def test_an_unchanged_status_is_not_sent_again(notify_socket):
    # the idle aggregator service reports "waiting for a run" on every pass of its loop
    path, recv = notify_socket
    notifier = Notifier(path)
    assert notifier.ready("aggregator: waiting for a run")
    assert recv() == "READY=1\nSTATUS=aggregator: waiting for a run"
    for _ in range(5):
        assert notifier.status("aggregator: waiting for a run")
    assert recv(0.3) is None
    assert notifier.status("aggregator: run r1, 0 of 3 rounds done")
    assert recv() == "STATUS=aggregator: run r1, 0 of 3 rounds done"
    assert notifier.stopping("stopping")          # STATUS sent with another field counts
    assert recv() == "STOPPING=1\nSTATUS=stopping"
    assert notifier.status("aggregator: waiting for a run")
    assert recv() == "STATUS=aggregator: waiting for a run"


def test_heartbeat_check_follows_the_main_loop_beats(notify_socket):
    path, recv = notify_socket
    notifier = Notifier(path)
    environ = {"WATCHDOG_USEC": "400000"}
    healthy = notifier.heartbeat_check(environ=environ)     # max_age: half of 0.4 s
    assert healthy()                     # start-up, before READY=1: TimeoutStartSec's business
    beat_at = time.monotonic()
    notifier.ready()                     # READY=1 is the first beat
    assert healthy()
    wait_for(lambda: not healthy(), timeout=10, what="the heartbeat check to fail")
    # ... only once no beat came for more than half the watchdog timeout
    assert time.monotonic() - beat_at >= 0.2
    notifier.beat()
    assert healthy()
    assert notifier.heartbeat_check(environ={})()           # no watchdog: nothing to check
    with pytest.raises(ValueError, match="max_age 0"):
        notifier.heartbeat_check(max_age=0)
    # the pinger with it: pings while the loop beats, silence once it stops
    loop_alive = notifier.heartbeat_check(max_age=0.3)
    pinger = notifier.watchdog_pinger(healthy=loop_alive, interval=0.05)
    recv(0.1)
    with pinger:
        def beating_until_pinged_thrice():
            notifier.beat()              # the main loop's beat, every poll
            return pinger.pings >= 3
        wait_for(beating_until_pinged_thrice, timeout=10, what="3 watchdog pings")
        # the loop is stuck (no more beats): once its check fails the pings stop
        wait_for(lambda: not loop_alive(), timeout=10, what="the stuck loop's check to fail")
        while recv(0.1) is not None:     # a ping sent before the check failed
            pass
        assert recv(0.3) is None
        notifier.beat()
        assert recv(1.0) == "WATCHDOG=1"


# ---------------------------------------------------------------------------------------
# signals: a real process, signalled mid-work
# ---------------------------------------------------------------------------------------

# The loop a role runs: local epochs in the C core until a stop signal, then the state is
# persisted atomically and the process exits 0. argv: state file, "ignore" to keep working
# after the first signal (then only a second signal ends it).
WORKER = r"""
import json, sys
import numpy as np
from edgefl import kernels
from edgefl.io import atomic_write
from edgefl.models import build_model
from edgefl.service.signals import install_stop_handlers

state_path, mode = sys.argv[1], sys.argv[2]
stop = install_stop_handlers()
rng = np.random.default_rng(0)
x = rng.standard_normal((2048, 64)).astype(np.float32)
y = rng.integers(0, 10, len(x)).astype(np.int32)
model = build_model({"name": "mlp", "hidden": [64]}, (64,), 10)
params = model.init(0)
cfg = kernels.train_config(lr=0.05, batch_size=32, epochs=1)
epochs, said = 0, False
print("working", flush=True)
while mode == "ignore" or not stop.is_set():
    kernels.local_train(model, params, x, y, cfg)
    epochs += 1
    if epochs == 1:
        print("epoch 1 done", flush=True)
    if mode == "ignore" and stop.is_set() and not said:
        print("still working after " + stop.name, flush=True)
        said = True
atomic_write(state_path, json.dumps({"epochs": epochs, "signal": stop.name,
                                     "params": params.tolist()}).encode())
sys.exit(0)
"""


def _start_worker(state, mode="stop"):
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(state), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for want in ("working\n", "epoch 1 done\n"):     # then mid-work: in epoch 2
        line = _next_line(proc)
        assert line == want, f"worker said {line!r}: " + proc.stderr.read()
    assert proc.poll() is None, "worker ended before it was signalled"
    return proc


def _next_line(proc, timeout=20.0) -> str:
    """The worker's next stdout line; a worker silent for `timeout` seconds is killed (its
    line is then "")."""
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        return proc.stdout.readline()
    finally:
        timer.cancel()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_ends_the_loop_persists_state_and_exits_0(tmp_path, signum):
    state = tmp_path / "state.json"
    proc = _start_worker(state)
    sent = time.monotonic()
    proc.send_signal(signum)
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running 5 s after {signum.name}")
    assert code == 0, proc.stderr.read()
    assert time.monotonic() - sent < 5
    saved = json.loads(state.read_text())
    assert saved["signal"] == signum.name
    assert saved["epochs"] >= 1
    params = np.array(saved["params"], dtype=np.float32)
    from edgefl.models import build_model
    init = build_model({"name": "mlp", "hidden": [64]}, (64,), 10).init(0)
    assert params.shape == init.shape and np.isfinite(params).all()
    assert not np.array_equal(params, init)             # the trained state, not the start
    assert not list(tmp_path.glob(".state.json.*"))     # no temporary file left behind


def test_second_signal_forces_exit(tmp_path):
    state = tmp_path / "state.json"
    proc = _start_worker(state, mode="ignore")          # keeps working after the first one
    proc.send_signal(signal.SIGTERM)
    # the first SIGTERM only requests a stop: the worker sees it and goes on
    assert _next_line(proc) == "still working after SIGTERM\n"
    assert proc.poll() is None, "the first SIGTERM must only request a stop"
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("a second SIGTERM did not end the process")
    assert code == -signal.SIGTERM
    assert not state.exists()
    # logged through logging's last-resort handler (the worker sets up no logging)
    assert "SIGTERM again while stopping: exiting now" in proc.stderr.read()


HANDLER_IN_THE_LOCK = r"""
import os, signal, sys
from edgefl.service.signals import install_stop_handlers
stop = install_stop_handlers()
# the main thread as it is for a few bytecodes of every stop.wait(): holding the event's
# lock. The handler runs at the next bytecode, inside this block.
with stop._event._cond:
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(1000):
        pass
print("the handler returned", flush=True)
print("stopped by " + str(stop.name) if stop.wait(5) else "not stopped", flush=True)
"""


def test_a_signal_while_the_main_thread_holds_the_events_lock_still_stops():
    # A service's main loop waits on its stop flag (stop.wait(poll)); a handler that set
    # the threading.Event itself took that lock again, and a signal arriving while the loop
    # held it (rare: CI's README test once hung 15 s on `edgefl broker`, and a loop of
    # wait(1e-6) hung 2 of 150 times) left the process stuck for good.
    try:
        done = subprocess.run([sys.executable, "-c", HANDLER_IN_THE_LOCK],
                              capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the process hung in its signal handler; it printed {exc.stdout!r}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["the handler returned", "stopped by SIGTERM"]


ANOTHER_WAKEUP_FD = r"""
import os, signal, socket
from edgefl.service.signals import install_stop_handlers
stop = install_stop_handlers()
theirs, _ = socket.socketpair()
theirs.setblocking(False)
signal.set_wakeup_fd(theirs.fileno())           # as asyncio's add_signal_handler does
os.kill(os.getpid(), signal.SIGTERM)
print("stopped by " + str(stop.name) if stop.wait(5) else "not stopped", flush=True)
"""


def test_a_stop_signal_stops_after_other_code_took_the_wakeup_fd():
    done = subprocess.run([sys.executable, "-c", ANOTHER_WAKEUP_FD],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["stopped by SIGTERM"]


WORKER_AFTER_FORK = r"""
import os, signal
from edgefl.service.signals import install_stop_handlers
from edgefl.sim.hosting import worker_stop_signal
stop = install_stop_handlers()                  # edgefl simulate's, in the parent
ready_r, ready_w = os.pipe()
pid = os.fork()
if pid == 0:                                    # a worker process of run_over_broker
    mine = worker_stop_signal()
    os.write(ready_w, b"ready")
    os._exit(0 if mine.wait(10) and mine.name == "SIGTERM" else 1)
print(os.read(ready_r, 5).decode(), flush=True)
os.kill(pid, signal.SIGTERM)
_, status = os.waitpid(pid, 0)
print("worker stopped" if os.waitstatus_to_exitcode(status) == 0 else "worker not stopped")
print("parent stopped" if stop.wait(1.0) else "parent running")
"""


def test_a_worker_process_stopped_alone_does_not_stop_the_parent():
    # A forked worker inherits the parent's wakeup fd: with only a Python handler of its
    # own, a SIGTERM to the worker woke the parent's watcher, which stopped the whole run.
    done = subprocess.run([sys.executable, "-c", WORKER_AFTER_FORK],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["ready", "worker stopped", "parent running"]


def test_handlers_are_restored_and_code_can_request_a_stop():
    before = signal.getsignal(signal.SIGTERM)
    with install_stop_handlers() as stop:
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        assert not stop.wait(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(1.0) and stop.name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == before
    stop = install_stop_handlers()
    try:
        stop.request()
        assert stop.is_set() and stop.signum is None
    finally:
        stop.restore()


# ---------------------------------------------------------------------------------------
# logging
# ---------------------------------------------------------------------------------------

def _log_to_file(tmp_path, monkeypatch, journal_env, level="info"):
    path = tmp_path / "log"
    stream = open(path, "w")
    st = os.fstat(stream.fileno())
    if journal_env == "match":
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    elif journal_env == "other":      # inherited from a parent whose stderr was the journal
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")
    else:
        monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    logger = logging.getLogger(f"edgefl.test.{journal_env}.{level}")
    logger.propagate = False
    setup_logging(level, stream=stream, logger=logger)
    return logger, stream, path


def test_journal_stream_gets_priorities_and_no_timestamps(tmp_path, monkeypatch):
    logger, stream, path = _log_to_file(tmp_path, monkeypatch, "match")
    assert stream_is_journal(stream)
    logger.debug("hidden at info")
    logger.info("round 3 opened")
    logger.warning("client pi-07 late")
    logger.error("frame rejected:\nbad CRC")
    logger.critical("disk full")
    stream.close()
    assert path.read_text().splitlines() == [
        f"<6>{logger.name}: round 3 opened",
        f"<4>{logger.name}: client pi-07 late",
        f"<3>{logger.name}: frame rejected:",
        "<3>bad CRC",                                   # every journal line keeps its level
        f"<2>{logger.name}: disk full",
    ]


@pytest.mark.parametrize("journal_env", ["unset", "other"])
def test_elsewhere_lines_are_timestamped(tmp_path, monkeypatch, journal_env):
    logger, stream, path = _log_to_file(tmp_path, monkeypatch, journal_env, level="debug")
    assert not stream_is_journal(stream)
    logger.debug("detail")
    logger.info("round 3 opened")
    stream.close()
    lines = path.read_text().splitlines()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    assert re.fullmatch(stamp + rf" DEBUG   {re.escape(logger.name)}: detail", lines[0]), lines
    assert re.fullmatch(stamp + rf" INFO    {re.escape(logger.name)}: round 3 opened", lines[1])


def test_levels_and_reconfiguration():
    logger = logging.getLogger("edgefl.test.levels")
    logger.propagate = False
    first, second = io.StringIO(), io.StringIO()
    setup_logging("WARNING", stream=first, logger=logger, journal=True)
    logger.info("dropped")
    logger.warning("kept")
    setup_logging("debug", stream=second, logger=logger, journal=True)   # replaces, no duplicate
    logger.debug("now shown")
    assert first.getvalue() == "<4>edgefl.test.levels: kept\n"
    assert second.getvalue() == "<7>edgefl.test.levels: now shown\n"
    assert len(logger.handlers) == 1
    with pytest.raises(ValueError, match=r"log level 'loud': valid levels are debug, info, "
                                         r"warning, error, critical"):
        setup_logging("loud", stream=first, logger=logger)


# ---------------------------------------------------------------------------------------
# edgefl status: the fleet table
# ---------------------------------------------------------------------------------------

def test_format_fleet():
    table = format_fleet([
        {"node": "pi-10", "online": False, "version": "0.1.0", "profile": "rpi3",
         "last_round": 11},
        {"node": "pi-2", "online": True, "version": "0.1.0", "profile": "rpi4",
         "last_round": 12},
        {"node": "pi-3", "online": True, "version": "0.0.9"},
    ])
    assert table.splitlines() == [
        "node   online  version  profile  last round",
        "pi-2   yes     0.1.0    rpi4     12",
        "pi-3   yes     0.0.9    -        -",
        "pi-10  no      0.1.0    rpi3     11",
        "3 nodes: 2 online, 1 offline",
    ]


def test_format_fleet_roles_unknown_and_empty():
    table = format_fleet([{"node": "gw", "role": "aggregator", "online": True, "last_round": 0},
                          {"node": "pi-1", "role": "client"}])
    assert table.splitlines()[0].split() == ["node", "role", "online", "version", "profile",
                                             "last", "round"]
    assert table.splitlines()[1].split() == ["gw", "aggregator", "yes", "-", "-", "0"]
    assert table.splitlines()[2].split() == ["pi-1", "client", "?", "-", "-", "-"]
    assert table.endswith("2 nodes: 1 online, 0 offline, 1 unknown")
    assert format_fleet([]) == "no nodes have published a status"
    with pytest.raises(TypeError, match="status 0 is str"):
        format_fleet(["pi-1"])


# ---------------------------------------------------------------------------------------
# the units
# ---------------------------------------------------------------------------------------

def _directives(text):
    """[(section, key, value)] of a unit file (keys may repeat, so not configparser)."""
    out, section = [], None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
        else:
            key, _, value = line.partition("=")
            out.append((section, key, value))
    return out


def _get(text, key):
    return [v for _, k, v in _directives(text) if k == key]


def test_devices_copies_match_the_packaged_units():
    shipped = sorted(p.name for p in UNITS.iterdir())
    assert shipped == sorted(p.name for p in DEVICES.iterdir()), "devices/systemd/ differs"
    for name in shipped:
        assert (UNITS / name).read_bytes() == (DEVICES / name).read_bytes(), \
            f"devices/systemd/{name} differs from edgefl/service/units/{name}: copy it over"


@pytest.mark.parametrize("role", ROLES)
def test_unit_directives(role):
    text = inst.unit_template(role)
    spec = inst.ROLE_UNITS[role]
    state = spec.template.split(".")[0].replace("edgefl-", "").replace("@", "-%i")
    expect = {
        "Type": ["notify"], "User": ["edgefl"], "Group": ["edgefl"],
        "Restart": ["on-failure"], "ProtectSystem": ["strict"], "ProtectHome": ["yes"],
        "PrivateTmp": ["yes"], "NoNewPrivileges": ["yes"], "CapabilityBoundingSet": [""],
        "StateDirectory": [f"edgefl/{state}"], "ReadWritePaths": [f"%S/edgefl/{state}"],
    }
    for key, value in expect.items():
        assert _get(text, key) == value, f"{spec.template}: {key}"
    assert int(_get(text, "WatchdogSec")[0]) >= 30
    exec_start = _get(text, "ExecStart")[0].split()
    site = spec.site_path("%i")
    assert exec_start == [inst.PYTHON_PLACEHOLDER, "-m", "edgefl.cli", spec.command,
                          "--config", site]
    if role != "infer":
        assert "network-online.target" in _get(text, "After")[0]
        assert "network-online.target" in _get(text, "Wants")[0]
    if role == "aggregator":
        assert "mosquitto.service" in _get(text, "After")[0]
        assert "mosquitto.service" in _get(text, "Wants")[0]
    if role == "infer":
        assert _get(text, "PrivateNetwork") == ["yes"]


@pytest.mark.parametrize("role", ROLES)
def test_a_units_state_directory_and_new_files_are_closed_to_other_accounts(role):
    """A board's state directory holds its stored update and progress, the aggregator's its
    checkpoints and every board's updates' sum: nothing in them is for other accounts on
    the host (docs/security.md, "Data at rest"). The service's group (edgefl; the
    inference service is the same user) may read, others may not even list them, and the
    umask keeps what the service creates with the default mode out of their reach too."""
    text = inst.unit_template(role)
    spec = inst.ROLE_UNITS[role]
    directory_mode = int(_get(text, "StateDirectoryMode")[0], 8)
    umask = int(_get(text, "UMask")[0], 8)
    assert directory_mode & 0o007 == 0, f"{spec.template}: StateDirectoryMode={directory_mode:04o}"
    assert umask & 0o007 == 0o007, f"{spec.template}: UMask={umask:04o}"


def test_every_unit_runs_a_command_of_this_edgefl():
    # the installer names the subcommand each unit's ExecStart runs (test_unit_directives
    # checks the unit files say the same); an edgefl without it would write units that
    # fail on every start
    for role, spec in inst.ROLE_UNITS.items():
        assert spec.command in COMMANDS, f"{role}: no `edgefl {spec.command}` command"
        # and the CLI takes the arguments ExecStart gives it
        argv = _get(inst.unit_template(role), "ExecStart")[0].split()[3:]
        args = build_parser().parse_args(argv)
        assert args._command is COMMANDS[spec.command] and args.site == spec.site_path("%i")


def test_a_launch_declares_only_its_own_subcommand(capsys):
    """`edgefl simulate ...` builds simulate's arguments alone, so a simulation does not pay
    for the service commands' settings modules (imported to show their defaults); every
    subcommand is still listed by `edgefl --help` and parses in full when named."""
    code = ("import sys; from edgefl.cli import build_parser; "
            "a = build_parser(only='simulate').parse_args(['simulate', 'x.yaml', '--quiet']); "
            "print(a.config, a.quiet, 'edgefl.service.layered' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["x.yaml", "True", "False"]
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = capsys.readouterr().out
    assert all(name in listed for name in COMMANDS)
    with pytest.raises(SystemExit):
        main(["config", "--help"])      # a service command's own arguments, in full
    assert "ACTION" in capsys.readouterr().out


def test_installer_site_file_is_what_the_unit_reads():
    for role, spec in inst.ROLE_UNITS.items():
        text = inst.render_unit(role, "/usr/bin/python3")
        node = "07" if spec.instance else "x"
        config = _get(text, "ExecStart")[0].split()[-1].replace("%i", node)
        assert config == spec.site_path(node)
        assert spec.unit_name(node) == ("edgefl-client@07.service" if role == "client"
                                        else spec.template)


def _usable_python():
    """An interpreter on this machine at a path the units' sandbox does not hide, for files
    staged under a prefix with the interpreter check off (check_python=False,
    --no-python-check): here sys.executable is under /root, and /usr/bin/python3 cannot
    import edgefl (the check's own tests are below)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            if os.path.isfile(candidate):
                return inst.check_interpreter(candidate, here=False)
        except inst.InstallError:
            continue
    pytest.skip("no interpreter outside /home, /root and /tmp on this machine")


SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(SYSTEMD_ANALYZE is None,
                                           reason="systemd-analyze is not installed")


def _rendered_units(tmp_path):
    """Each unit with a real interpreter, as files systemd-analyze can load (an instance
    name for the client template)."""
    out = []
    for role, spec in inst.ROLE_UNITS.items():
        path = tmp_path / spec.unit_name("07")
        path.write_text(inst.render_unit(role, sys.executable))
        out.append(path)
    return out


@needs_systemd_analyze
def test_systemd_analyze_verify_accepts_the_units(tmp_path):
    for path in _rendered_units(tmp_path):
        result = subprocess.run([SYSTEMD_ANALYZE, "verify", "--man=no", str(path)],
                                capture_output=True, text=True, timeout=60)
        # verify exits 0 on most problems and only prints them: any output is a failure
        assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), \
            f"{path.name}: {result.stdout}{result.stderr}"


@needs_systemd_analyze
def test_systemd_analyze_verify_catches_a_broken_unit(tmp_path):
    # the check above can fail: a misspelt value is reported
    path = tmp_path / "edgefl-aggregator.service"
    path.write_text(inst.render_unit("aggregator", sys.executable).replace(
        "ProtectSystem=strict", "ProtectSystem=strickt"))
    result = subprocess.run([SYSTEMD_ANALYZE, "verify", "--man=no", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert "ProtectSystem" in result.stderr or "protect system" in result.stderr.lower()


@needs_systemd_analyze
def test_sandbox_exposure_is_low(tmp_path):
    for path in _rendered_units(tmp_path):
        result = subprocess.run([SYSTEMD_ANALYZE, "security", "--offline=true",
                                 "--threshold=20", "--no-pager", str(path)],
                                capture_output=True, text=True, timeout=60)
        if "Unknown option" in result.stderr or "unrecognized option" in result.stderr:
            pytest.skip("systemd-analyze security --offline needs systemd >= 250")
        level = re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout)
        assert result.returncode == 0 and level, result.stdout[-500:] + result.stderr
        assert float(level.group(1)) <= 2.0, f"{path.name}: exposure {level.group(1)}"


# ---------------------------------------------------------------------------------------
# edgefl install-service
# ---------------------------------------------------------------------------------------

def test_install_client_writes_unit_site_file_and_sysusers(tmp_path):
    python = _usable_python()
    plan = inst.plan_install("client", "07", profile="rpi4", prefix=str(tmp_path), python=python,
                             check_python=False)
    done = inst.install(plan)
    unit = tmp_path / "etc/systemd/system/edgefl-client@.service"
    site = tmp_path / "etc/edgefl/client-07.yaml"
    sysusers = tmp_path / "etc/sysusers.d/edgefl.conf"
    assert done == [(str(unit), "written"), (str(site), "written"), (str(sysusers), "written")]
    text = unit.read_text()
    assert _get(text, "ExecStart") == [f"{python} -m edgefl.cli client --config "
                                       f"/etc/edgefl/client-%i.yaml"]
    assert inst.PYTHON_PLACEHOLDER not in text.split("[Service]")[1].split("\n#")[0]
    assert oct(unit.stat().st_mode & 0o777) == "0o644"
    assert sysusers.read_text().splitlines()[-1].split()[:2] == ["u", "edgefl"]
    assert plan.commands == (("systemd-sysusers", "/etc/sysusers.d/edgefl.conf"),
                             ("systemctl", "daemon-reload"),
                             ("systemctl", "enable", "--now", "edgefl-client@07.service"))
    # the skeleton is a valid site file for the client, and keeps "07" a string
    skeleton = yaml.safe_load(site.read_text())
    assert skeleton["node"]["id"] == "07" and skeleton["profile"] == "rpi4"
    config = load_service_config("client", str(site))
    assert config["node.id"] == "07"
    assert config.source("node.id").file == str(site)
    assert config.source("compute.threads").layer == "device profile"
    # the profile's values are listed commented out; uncommented they are the same values
    text = site.read_text()
    # the profile named by name and its place in the package, not by this machine's path
    # (the files may be staged for another machine)
    assert "# The profile's settings (rpi4, edgefl/profiles/rpi4.yaml in the package); " \
        "uncomment to override:" in text
    assert (REPO / "edgefl" / "profiles" / "rpi4.yaml").is_file()
    import edgefl
    assert os.path.dirname(os.path.dirname(os.path.abspath(edgefl.__file__))) not in text
    listed = text[text.index("# The profile's settings"):].splitlines()[1:]
    site.write_text(text + "\n".join(line[2:] for line in listed) + "\n")
    edited = load_service_config("client", str(site))
    for key in ("compute.threads", "compute.memory_budget_mb", "train.batch_size",
                "transport.compression", "transport.chunk_size", "suggested_model"):
        assert edited[key] == config[key], key
        assert edited.source(key).file == str(site), key


@pytest.mark.parametrize("role, node_id, unit", [
    ("aggregator", None, "edgefl-aggregator.service"),
    ("infer", "07", "edgefl-infer.service"),
])
def test_install_other_roles(tmp_path, role, node_id, unit):
    plan = inst.plan_install(role, node_id, profile="generic-x86", prefix=str(tmp_path),
                             python=_usable_python(), check_python=False)
    inst.install(plan)
    assert plan.unit == unit
    site = tmp_path / "etc/edgefl" / f"{role}.yaml"
    if role == "infer":
        config = load_service_config("infer", str(site))
        assert config["infer.model"] == "/var/lib/edgefl/client-07/model.onnx"
        assert config["infer.threads"] == 2          # generic-x86.yaml
    else:
        config = load_service_config("aggregator", str(site))
        assert config["node.id"] == "aggregator" and config["run"].endswith("quickstart.yaml")


def test_reinstall_keeps_the_edited_site_file(tmp_path):
    python = _usable_python()
    plan = inst.plan_install("client", "a1", profile="rpi3", prefix=str(tmp_path), python=python,
                             check_python=False)
    inst.install(plan)
    site = tmp_path / "etc/edgefl/client-a1.yaml"
    site.write_text(site.read_text().replace("mqtt://localhost:1883", "mqtt://gw.lan:1883"))
    done = dict(inst.install(plan))
    assert done[str(site)] == "kept (exists)"
    assert "mqtt://gw.lan:1883" in site.read_text()
    assert done[str(tmp_path / "etc/systemd/system/edgefl-client@.service")] == "unchanged"


def test_reinstall_says_what_the_kept_site_file_does_not_take(tmp_path, capsys):
    """A site file that exists is kept as the operator edited it, so a second install's
    --profile, --signing-key and --trust-key do not reach it: the report said "profile rpi4
    (from --profile)" and "written" for the keys while the service ran on with rpi3 and
    signed nothing. It says which profile the service runs with, and what to add."""
    from edgefl.transport.signing import write_key_pair

    stage = tmp_path / "stage"
    args = ["install-service", "--role", "client", "--id", "a1", "--prefix", str(stage),
            "--python", "/opt/edgefl/venv/bin/python", "--no-python-check"]
    assert main(args + ["--profile", "rpi3"]) == 0
    site = stage / "etc/edgefl/client-a1.yaml"
    capsys.readouterr()
    assert main(args + ["--profile", "rpi4"]) == 0
    out = capsys.readouterr().out
    assert "profile rpi3 (its site file's, kept; --profile rpi4 not applied)" in out, out
    assert f"warning: {site} exists and is kept as it is: it says profile: rpi3, not rpi4 " \
        "(--profile); edit it to change that" in out
    assert yaml.safe_load(site.read_text())["profile"] == "rpi3"
    _, public = write_key_pair(tmp_path / "agg")
    assert main(args + ["--profile", "rpi3", "--signing-key", "new",
                        "--trust-key", public]) == 0
    out = capsys.readouterr().out
    assert "profile rpi3 (from --profile)" in out
    assert f"warning: {site} exists and is kept as it is: it does not set " \
        "keys.signing_key: /etc/edgefl/keys/client-a1.key, keys.aggregator: " \
        "[/etc/edgefl/keys/aggregator-0.pub]; add them to it, or the service does not " \
        "use the keys installed" in out, out
    # once the site file names them, a reinstall with the same keys has nothing to say
    site.write_text(site.read_text().replace("# keys:", "keys:\n  signing_key: "
                                             "/etc/edgefl/keys/client-a1.key\n  aggregator: "
                                             "[/etc/edgefl/keys/aggregator-0.pub]\n# was:"))
    key = stage / "etc/edgefl/keys/client-a1.key"
    assert main(args + ["--profile", "rpi3", "--signing-key", str(key),
                        "--trust-key", public]) == 0
    assert "warning: " + str(site) not in capsys.readouterr().out


def test_reinstall_over_a_site_file_that_does_not_read_names_it_and_keeps_it(tmp_path,
                                                                            capsys):
    """A kept site file saved as Latin-1 (an editor's choice): the install keeps it, and its
    report says the service cannot start until it is fixed, naming the file and the byte,
    as `edgefl config show` would (one reading of a config file's text)."""
    stage = tmp_path / "stage"
    args = ["install-service", "--role", "client", "--id", "a1", "--prefix", str(stage),
            "--python", "/opt/edgefl/venv/bin/python", "--no-python-check"]
    assert main(args + ["--profile", "rpi3"]) == 0
    site = stage / "etc/edgefl/client-a1.yaml"
    edited = site.read_text().replace("# keys:", "# clé:").encode("latin-1")
    site.write_bytes(edited)
    capsys.readouterr()
    assert main(args + ["--profile", "rpi3"]) == 0
    out = capsys.readouterr().out
    assert f"warning: {site} exists and is kept as it is, but it does not read ({site}: " \
           "not UTF-8 text (byte 0xe9 at offset" in out, out
    assert site.read_bytes() == edited


def test_dry_run_writes_nothing(tmp_path, capsys):
    python = _usable_python()
    code = main(["install-service", "--role", "client", "--id", "07", "--profile", "rpi4",
                 "--prefix", str(tmp_path), "--python", python, "--no-python-check",
                 "--dry-run"])
    assert code == 0
    assert not any(tmp_path.iterdir())
    out = capsys.readouterr().out
    assert f"would write  {tmp_path}/etc/edgefl/client-07.yaml" in out
    assert f"--- {tmp_path}/etc/systemd/system/edgefl-client@.service" in out


def test_cli_install_service_prints_the_systemctl_commands(tmp_path, capsys):
    python = _usable_python()
    code = main(["install-service", "--role", "client", "--id", "pi-07", "--profile",
                 "rpi-zero2w", "--prefix", str(tmp_path), "--python", python,
                 "--no-python-check"])
    assert code == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == (f"edgefl-client@pi-07.service: client pi-07, profile rpi-zero2w "
                        f"(from --profile), interpreter {python}")
    i = lines.index(f"staged under {tmp_path}: copy the files to / (their paths inside are "
                    f"final), then on the board, as root:")
    assert lines[i + 1:i + 4] == ["  systemd-sysusers /etc/sysusers.d/edgefl.conf",
                                  "  systemctl daemon-reload",
                                  "  systemctl enable --now edgefl-client@pi-07.service"]
    assert (tmp_path / "etc/edgefl/client-pi-07.yaml").exists()


@pytest.mark.parametrize("args, message", [
    (["--role", "client"], r"--role client needs --id \(the client id\)"),
    (["--role", "infer"], r"--role infer needs --id \(the id of the client whose model"),
    (["--role", "client", "--id", "a/b"], r"--id 'a/b': use 1-64 letters, digits"),
    (["--role", "client", "--id", "07", "--profile", "pi4"],
     r"--profile: unknown profile 'pi4'; valid profiles: generic-x86, jetson-nano, rpi-zero2w"),
    (["--role", "client", "--id", "07", "--python", "python3"],
     r"interpreter 'python3': need an absolute path"),
    (["--role", "client", "--id", "07", "--python", "/nonexistent/bin/python"],
     r"interpreter /nonexistent/bin/python: no such executable file"),
])
def test_install_errors_name_the_cause(tmp_path, capsys, args, message):
    if "--python" not in args:
        args = args + ["--python", _usable_python(), "--no-python-check"]
    code = main(["install-service", *args, "--prefix", str(tmp_path)])
    assert code == 1
    err = capsys.readouterr().err
    assert re.search(r"^edgefl install-service: error: " + message, err), err
    assert not any(tmp_path.iterdir())


def test_interpreter_hidden_by_the_sandbox_is_refused(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    with pytest.raises(inst.InstallError, match=r"is under /tmp, which the units' sandbox hides "
                                                r"\(ProtectHome=yes, PrivateTmp=yes\)"):
        inst.check_interpreter(str(fake))
    with pytest.raises(inst.InstallError, match=r"characters systemd's ExecStart would interpret"):
        inst.check_interpreter("/opt/my venv/bin/python")


def test_a_dry_run_from_a_development_venv_shows_the_files_and_why_a_real_install_stops(
        tmp_path, capsys):
    """The README's `edgefl install-service ... --dry-run` works from a venv under /home or
    /tmp: the files and commands are shown, the interpreter's problem is a warning naming the
    recipe; without --dry-run the same command fails with that message and writes nothing."""
    venv_python = tmp_path / "venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.symlink_to(sys.executable)
    stage = tmp_path / "stage"
    argv = ["install-service", "--role", "client", "--id", "pi-01", "--profile", "rpi4",
            "--python", str(venv_python), "--prefix", str(stage)]
    assert main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would write  {stage}/etc/systemd/system/edgefl-client@.service" in out
    assert f"ExecStart={venv_python} -m edgefl.cli client" in out
    warning = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert len(warning) == 1 and "a real install stops here: interpreter" in warning[0]
    assert "is under /tmp, which the units' sandbox hides" in warning[0]
    assert '"From a development checkout"' in warning[0]
    assert not stage.exists()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"edgefl install-service: error: interpreter {venv_python} is under "
                          f"/tmp") and '"From a development checkout"' in err
    assert not stage.exists()
    plan = inst.plan_install("client", "pi-01", profile="rpi4", python=str(venv_python),
                             prefix=str(stage), dry_run=True)
    with pytest.raises(inst.InstallError, match="is under /tmp"):
        inst.install(plan)                   # a dry run's plan is never written
    assert not stage.exists()


def test_config_show_finds_the_client_site_file_install_service_wrote(tmp_path, capsys):
    # install-service writes /etc/edgefl/client-<id>.yaml; /etc/edgefl/client.yaml, the
    # default site file, is not what an installed client reads
    inst.install(inst.plan_install("client", "07", profile="rpi4", prefix=str(tmp_path),
                                   python=_usable_python(), check_python=False))
    etc = str(tmp_path / "etc" / "edgefl")
    installed = f"{etc}/client-07.yaml"
    config = load_service_config("client", node_id="07", etc_dir=etc)
    assert config["node.id"] == "07" and config.source("node.id").file == installed
    # without it: the error and the layer note say which file to name, and how
    hint = (f"an installed client's site file is {etc}/client-<id>.yaml, which `edgefl "
            f"install-service --role client --id ID` writes: name it with --config FILE "
            f"(edgefl config show: --id ID or --config FILE); there are {installed}")
    with pytest.raises(ConfigError) as exc:
        load_service_config("client", None, etc_dir=etc)
    assert str(exc.value) == (f"node.id: not set, and the client needs it (this node's id "
                              f"(one MQTT topic level)); no site file was read ({etc}/"
                              f"client.yaml does not exist); {hint}, or set node.id with "
                              f"--set node.id=...")
    config = load_service_config("client", None, etc_dir=etc,
                                 overrides=["node.id=a", "data.name=digits"])
    site_layer = [layer for layer in config.layers if layer.kind == "site file"][0]
    assert site_layer.file is None
    assert site_layer.note == f"none: {etc}/client.yaml does not exist; {hint}"
    # --id is a client's, instead of the site file, and names a file that must exist
    with pytest.raises(ConfigError, match=r"^--id 07 and the site file /x.yaml both name"):
        load_service_config("client", "/x.yaml", node_id="07", etc_dir=etc)
    with pytest.raises(ConfigError, match=rf"^--id 07: only a client's site file is per id "
                                          rf"\({etc}/client-07.yaml\); the aggregator's is "
                                          rf"{etc}/aggregator.yaml$"):
        load_service_config("aggregator", node_id="07", etc_dir=etc)
    with pytest.raises(ConfigError, match=rf"^{etc}/client-08.yaml: config file does not exist"):
        load_service_config("client", node_id="08", etc_dir=etc)
    # the command line: --id selects /etc/edgefl/client-ID.yaml
    assert main(["config", "show", "--id", "no-such-client-x9"]) == 1
    assert ("edgefl config: error: /etc/edgefl/client-no-such-client-x9.yaml: config file does "
            "not exist") in capsys.readouterr().err
    assert main(["config", "show", "--id", "07", "--site", installed]) == 1
    assert "--id 07 and the site file" in capsys.readouterr().err


def _python_without_edgefl():
    """A real interpreter that cannot import edgefl (the system's python3 here), or skip."""
    python = "/usr/bin/python3"
    if not os.path.isfile(python) or subprocess.run(
            [python, "-c", "import edgefl"], cwd="/", capture_output=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
            timeout=120).returncode == 0:
        pytest.skip(f"{python} is missing or imports edgefl")
    return python


def test_interpreter_that_cannot_import_edgefl_is_refused(tmp_path, capsys, monkeypatch):
    python = _python_without_edgefl()
    # run from a checkout with PYTHONPATH pointing at it, the installer's own shell could
    # import edgefl with that python; the unit, from its state directory, could not
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    args = ["install-service", "--role", "client", "--id", "07", "--profile", "rpi4",
            "--python", python, "--prefix", str(tmp_path)]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert (f"edgefl install-service: error: interpreter {python} cannot import edgefl "
            f"(ModuleNotFoundError: No module named 'edgefl'), so the unit would fail on every "
            f"start: install edgefl into that interpreter's environment") in err, err
    assert "--no-python-check skips this check" in err
    assert not any(tmp_path.iterdir())
    # staging for another machine: the check is skipped on request, and the report says so
    assert main(args + ["--no-python-check"]) == 0
    out = capsys.readouterr().out
    assert (f"warning: interpreter {python} not checked (--no-python-check): on the machine "
            f"the files are for, it must exist and `{python} -c 'import edgefl'` must succeed"
            in out), out
    assert f"ExecStart={python} -m edgefl.cli client" in \
        (tmp_path / "etc/systemd/system/edgefl-client@.service").read_text()
    # ... and only when staging: a unit for this machine runs this machine's interpreter
    with pytest.raises(inst.InstallError, match=r"--no-python-check is for staging files with "
                                                r"--prefix for another machine"):
        inst.plan_install("client", "07", profile="rpi4", python=python, check_python=False)


def test_import_check_runs_the_interpreter_as_the_unit_would():
    # this interpreter imports edgefl (installed in its environment): accepted
    inst.check_imports_edgefl(sys.executable)
    with pytest.raises(inst.InstallError, match=r"interpreter /nonexistent/python: cannot run "
                                                r"it \(No such file or directory\)"):
        inst.check_imports_edgefl("/nonexistent/python")


def test_interpreter_linked_into_a_hidden_directory_is_refused():
    # a venv's python is a symlink to the Python it was made with: one under /root or /home
    # is hidden from the service just the same
    real = os.path.realpath(sys.executable)
    if not any(real.startswith(h + "/") for h in inst.HIDDEN_FROM_SERVICE) \
            or not os.path.isdir("/dev/shm"):
        pytest.skip("this interpreter is not under a hidden directory (or no /dev/shm)")
    directory = tempfile.mkdtemp(dir="/dev/shm", prefix="edgefl-venv-")
    try:
        link = os.path.join(directory, "python")
        os.symlink(sys.executable, link)
        with pytest.raises(inst.InstallError, match=rf"interpreter {re.escape(link)} \(a link "
                                                    rf"to {re.escape(real)}\) is under /"):
            inst.check_interpreter(link)
        assert inst.check_interpreter(link, here=False) == link   # staging: the path only
    finally:
        shutil.rmtree(directory)


@needs_systemd_analyze
def test_installed_unit_passes_verify(tmp_path):
    python = _usable_python()
    inst.install(inst.plan_install("client", "07", profile="rpi4", prefix=str(tmp_path),
                                   python=python, check_python=False))
    unit = (tmp_path / "etc/systemd/system/edgefl-client@.service").read_text()
    instance = tmp_path / "edgefl-client@07.service"
    instance.write_text(unit)
    result = subprocess.run([SYSTEMD_ANALYZE, "verify", "--man=no", str(instance)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), \
        result.stdout + result.stderr


@pytest.mark.parametrize("value", ["-1", "0"])
def test_status_refuses_a_wait_of_zero_or_less_naming_the_option(capsys, value):
    # `status --wait -1` was accepted and listed no nodes, as if none had published; it is
    # refused before connecting (a closed port here, never the system broker)
    assert usage_error(["status", "--broker", "mqtt://127.0.0.1:1", "--wait", value],
                       capsys) == (f"edgefl status: error: argument --wait: need a number of "
                                   f"seconds > 0, got {value}")


def test_a_second_process_of_a_role_on_a_state_directory_in_use_is_refused(tmp_path, capsys):
    """Two aggregators (or two clients) on one state directory overwrote each other's
    checkpoint and records and took the broker client id from each other over and over (one
    never exited). The second is refused at start, naming the directory and the process that
    holds it, before it reads data or reaches the broker (a closed port here) or writes
    anything; another role may share the directory; a holder killed with SIGKILL holds
    nothing."""
    from edgefl.roles.state import hold_state_dir

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from edgefl.roles.state import hold_state_dir\n"
         "with hold_state_dir(sys.argv[1], 'aggregator'), "
         "hold_state_dir(sys.argv[1] + '/edge', 'edge'), hold_state_dir(sys.argv[2], 'client'):\n"
         "    print('held', flush=True); time.sleep(120)\n",
         str(tmp_path / "S"), str(tmp_path / "C")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        common = ["--set", "node.federation=lab", "--set", "broker.url=mqtt://127.0.0.1:1"]
        for role, argv, where in (
                ("aggregator", ["aggregator", "--set", "node.id=agg", "--once"], "S"),
                ("client", ["client", "--set", "node.id=b1", "--set", "data.name=digits"], "C")):
            assert main(argv + ["--set", f"state_dir={tmp_path / where}"] + common) == 1
            d = tmp_path / where
            assert capsys.readouterr().err == (
                f"edgefl {role}: error: {d}: the state directory is in use by another edgefl "
                f"{role} (process {holder.pid}; {d / (role + '.lock')}): two would overwrite "
                f"each other's state; stop that one, or give this one a state_dir of its "
                f"own\n")
        assert sorted(os.listdir(tmp_path / "S")) == ["aggregator.lock", "edge"]
        assert os.listdir(tmp_path / "C") == ["client.lock"]
        with hold_state_dir(tmp_path / "S", "client"):        # another role: not in its way
            pass
    finally:
        holder.kill()
        holder.wait()
    with hold_state_dir(tmp_path / "S", "aggregator") as lock, \
            hold_state_dir(tmp_path / "C", "client"):
        assert Path(lock).read_text() == f"process {os.getpid()}\n"
