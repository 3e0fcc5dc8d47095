"""A fleet on one machine: `edgefl fleet up / status / down`.

`up` writes, into one directory, the files a real deployment uses -- the broker's accounts
(edgefl.service.accounts: one per connection, bound to its client id), a Mosquitto config
that loads them, a site file per node, two run configs -- and starts, as background
processes, the broker, the aggregator service and N client services with the entry points
the systemd units run (`python -m edgefl.cli aggregator|client --config SITE`). It returns
once every node has published that it is online. `status` says which processes are alive
and what the nodes publish; `down` stops them with SIGTERM, as systemd would, and keeps
every file, so `up` on the same directory starts the same fleet again (same accounts, same
state, same port).

    DIR/fleet.json                  what runs: each process's pid, command and log (`down`
                                    and `status` read it)
    DIR/aggregator.yaml             site files: node id, federation, broker URL and account,
    DIR/client-<i>.yaml             state directory (relative paths: DIR can move)
    DIR/digits.yaml, DIR/long.yaml  run configs for `edgefl ctl start` (a 5-round run, and
                                    a long one to pause, resume and stop)
    DIR/broker/mosquitto.conf       the broker (Mosquitto with the dynamic security plugin)
    DIR/broker/dynamic-security.json  its accounts, hashed passwords and access (0600)
    DIR/credentials/<account>.pw    each account's password (0600)
    DIR/state/<node>/               each node's state directory
    DIR/logs/<process>.log          each process's output

Without Mosquitto (or without its dynamic security plugin) the broker is the embedded one
(`edgefl broker`, amqtt), which takes any login: the files are the same, the access
control is not enforced, and `up` says so.

docs/examples/fleet/ is `write_examples`' output (tests/test_fleet.py keeps it current).
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field

from .io import atomic_write, write_json
from .service.accounts import (CREDENTIALS_DIR, DYNSEC_FILE, OPERATOR,
                               control_username, federation_accounts, find_dynsec_plugin,
                               write_accounts)
from .transport.broker import find_mosquitto, free_port, have_python_broker, probe

__all__ = ["FleetError", "FleetService", "Fleet", "up", "down", "fleet_status",
           "client_ids", "site_files", "run_configs", "mosquitto_conf", "fleet_command",
           "write_examples",
           "FLEET_RECORD", "DEFAULT_CLIENTS", "DEFAULT_FEDERATION", "DEFAULT_DIR"]

FLEET_RECORD = "fleet.json"
DEFAULT_CLIENTS = 4
DEFAULT_FEDERATION = "lab"
DEFAULT_DIR = "fleet"
AGGREGATOR = "aggregator"
READY_TIMEOUT = 180.0       # a loaded 2-core machine starting 5 Pythons that load data sets
STOP_TIMEOUT = 30.0         # a client stops within one local step; the broker saves its state


class FleetError(RuntimeError):
    """The fleet cannot be brought up, or its directory is not a fleet's: the message names
    the directory, the process and the cause."""


def client_ids(n: int) -> list:
    """The board ids of a fleet of n: client-1 ... client-n (docs/orchestration.md's)."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64:
        raise FleetError(f"--clients {n!r}: a fleet on one machine has 1 to 64 clients")
    return [f"client-{i}" for i in range(1, n + 1)]


# ------------------------------------------------------------------ the files
def _site_header(what: str) -> str:
    return (f"# {what},\n# written by `edgefl fleet up`; relative paths are relative to this "
            "file. On real\n# machines some keys change: docs/deployment.md says which.\n")


def _yaml_lines(*rows) -> str:
    """YAML lines, each (text) or (text, comment) with the comments in one column."""
    out = []
    for row in rows:
        text, comment = (row, None) if isinstance(row, str) else row
        out.append(f"{text:<41} # {comment}" if comment else text)
    return "\n".join(out) + "\n"


def site_files(federation: str, clients: list, url: str) -> dict:
    """{file name: YAML text} of each node's site file."""
    agg_ctl = control_username(AGGREGATOR)
    files = {"aggregator.yaml": _site_header(
        "the aggregator service's site file (edgefl aggregator --config)") + _yaml_lines(
        f"node: {{id: {AGGREGATOR}, federation: {federation}}}",
        "broker:",
        f"  url: \"{url}\"",
        (f"  username: {AGGREGATOR}", f"its rounds' connection (client id {AGGREGATOR})"),
        f"  password_file: {CREDENTIALS_DIR}/{AGGREGATOR}.pw",
        (f"  control_username: {agg_ctl}", f"its control connection (client id {agg_ctl})"),
        f"  control_password_file: {CREDENTIALS_DIR}/{agg_ctl}.pw",
        (f"state_dir: state/{AGGREGATOR}", "runs/<id>/: records, checkpoints, outputs"),
        (f"clients: [{', '.join(clients)}]", "the boards, in the order of a run's partition"),
        ("round: {deadline: 60}", "a start command may override it"),
        "log: {level: info}")}
    for client in clients:
        files[f"{client}.yaml"] = _site_header(
            f"board {client}'s site file (edgefl client --config)") + _yaml_lines(
            f"node: {{id: {client}, federation: {federation}}}",
            "broker:",
            f"  url: \"{url}\"",
            (f"  username: {client}", f"its own account, bound to client id {client}"),
            f"  password_file: {CREDENTIALS_DIR}/{client}.pw",
            (f"state_dir: state/{client}", "progress, stored update, installed model.onnx"),
            "log: {level: info}")
    return files


def run_configs(n_clients: int) -> dict:
    """{file name: YAML text} of the fleet's run configs, for `edgefl ctl start`."""
    body = (f"dataset: {{name: digits}}\n"
            f"partition: {{name: iid, clients: {n_clients}}}   # one shard per board\n"
            "model: {name: softmax}\n"
            "strategy: {name: fedavg}\n"
            "train: {lr: 0.1, batch_size: 32, epochs: 1}\n")
    return {
        "digits.yaml": ("# FedAvg on scikit-learn's 8x8 digits over the fleet's boards, 5 "
                        "rounds (seconds).\n# The clients were started with --partition on "
                        "this file: each trains on its shard.\n" + body + "rounds: 5\nseed: 0\n"),
        "long.yaml": ("# digits.yaml with 1000 rounds: a run to pause, resume and stop "
                      "(edgefl ctl).\n" + body + "rounds: 1000\nseed: 0\n"),
    }


def mosquitto_conf(port: int, plugin: str, as_root: bool = False) -> str:
    """The fleet broker's config: broker/mosquitto.conf's global options (queues, packet
    size, persistence, Nagle off) with one plain listener on 127.0.0.1 and the dynamic
    security plugin reading the fleet's accounts. Paths are relative to DIR/broker, where
    Mosquitto is started."""
    lines = [
        "# Mosquitto for an edgefl fleet on one machine, written by `edgefl fleet up` and run",
        "# from this directory (the paths are relative). The global options are",
        "# broker/mosquitto.conf's; a gateway uses that file, with TLS, and this directory's",
        f"# {DYNSEC_FILE} (docs/brokers.md, docs/deployment.md).",
        "per_listener_settings false",
        f"listener {int(port)} 127.0.0.1",
        "allow_anonymous false",
        "# every account is bound to its client id: another account asking for it is refused",
        f"plugin {plugin}",
        f"plugin_opt_config_file {DYNSEC_FILE}",
        "set_tcp_nodelay true",
        "max_packet_size 33554432",
        "persistent_client_expiration 7d",
        "max_inflight_messages 20",
        "max_queued_messages 10000",
        "max_queued_bytes 268435456",
        "persistence true",
        "persistence_location ./",
        "autosave_interval 60",
        "log_dest stderr",
        "log_type error",
        "log_type warning",
        "log_type notice",
        "connection_messages true",
    ]
    if as_root:
        # Started as root, Mosquitto drops to user "mosquitto", which cannot read this
        # directory's 0600 files: a fleet on one machine stays the user who started it.
        lines.append("user root")
    return "\n".join(lines) + "\n"


def _write_text(path: str, text: str, mode: int = 0o644) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write(path, text, mode=mode)


def _write_files(directory: str, federation: str, clients: list, port: int,
                 plugin: str | None, as_root: bool) -> None:
    """Every file of a new fleet (the accounts first: they refuse to replace old ones)."""
    accounts = federation_accounts(federation, clients, aggregator=AGGREGATOR)
    write_accounts(accounts, directory)
    for name, text in run_configs(len(clients)).items():
        _write_text(os.path.join(directory, name), text)
    _write_port_files(directory, federation, clients, port, plugin, as_root)


def _write_port_files(directory: str, federation: str, clients: list, port: int,
                      plugin: str | None, as_root: bool) -> None:
    """The files that name the broker's port: the site files and Mosquitto's config."""
    url = f"mqtt://127.0.0.1:{port}"
    for name, text in site_files(federation, clients, url).items():
        _write_text(os.path.join(directory, name), text)
    if plugin is not None:
        _write_text(os.path.join(directory, "broker", "mosquitto.conf"),
                    mosquitto_conf(port, plugin, as_root))


def write_examples(directory: str, clients: int = 2, federation: str = DEFAULT_FEDERATION,
                   port: int = 1883) -> None:
    """docs/examples/fleet/: what `fleet up` writes, on the standard port, for a non-root
    user, with the secrets left out (no credentials/, the hashes in the accounts file
    replaced by "<generated>")."""
    ids = client_ids(clients)
    plugin = "/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so"
    for name, text in {**site_files(federation, ids, f"mqtt://127.0.0.1:{port}"),
                       **run_configs(len(ids)),
                       "broker/mosquitto.conf": mosquitto_conf(port, plugin)}.items():
        _write_text(os.path.join(directory, name), text)
    from .service.accounts import dynsec_state

    state = dynsec_state(federation_accounts(federation, ids, aggregator=AGGREGATOR))
    for entry in state["clients"]:
        entry.update(password="<generated>", salt="<generated>")
    _write_text(os.path.join(directory, "broker", DYNSEC_FILE),
                json.dumps(state, indent=1) + "\n")


# ------------------------------------------------------------------ processes
@dataclass
class FleetService:
    """One background process of the fleet: its name (its log is logs/<name>.log), its
    command, and the directory it runs in. The dashboard (`edgefl dashboard`), when it
    exists, is one more of these, passed to `up(extra_services=...)`."""
    name: str
    argv: list
    cwd: str | None = None


@dataclass
class Fleet:
    directory: str
    federation: str
    clients: list
    port: int
    broker: str                         # "mosquitto" (access-controlled) or "embedded"
    processes: dict = field(default_factory=dict)   # name -> {pid, start, argv, log}

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def path(self, *parts: str) -> str:
        return os.path.join(self.directory, *parts)

    def record(self) -> dict:
        return {"v": 1, "federation": self.federation, "clients": self.clients,
                "port": self.port, "broker": self.broker, "url": self.url,
                "processes": self.processes}

    def save(self) -> None:
        write_json(self.path(FLEET_RECORD), self.record())

    @classmethod
    def load(cls, directory: str) -> "Fleet":
        path = os.path.join(directory, FLEET_RECORD)
        try:
            with open(path, encoding="utf-8") as fh:
                doc = json.load(fh)
            return cls(directory, doc["federation"], list(doc["clients"]), int(doc["port"]),
                       doc["broker"], dict(doc.get("processes") or {}))
        except FileNotFoundError:
            raise FleetError(f"{directory}: no fleet here ({FLEET_RECORD} is missing); "
                             f"`{fleet_command('up', directory)}` makes one") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise FleetError(f"{path}: not a fleet record ({exc})") from None

    def ctl_command(self, action: str = "start", *rest: str) -> str:
        """The `edgefl ctl` command line for this fleet, as the operator."""
        parts = ["edgefl", "ctl", action, *map(_shown, rest), "--config",
                 _shown(self.path("aggregator.yaml")), "--username", OPERATOR,
                 "--password-file", _shown(self.path(CREDENTIALS_DIR, f"{OPERATOR}.pw"))]
        if self.broker == "embedded" and not find_mosquitto():
            parts += ["--mqtt", "3.1.1"]        # amqtt speaks MQTT 3.1.1 only
        return shlex.join(parts)         # as fleet_command


def fleet_command(action: str, directory: str) -> str:
    """`edgefl fleet ACTION --dir DIR` to copy into a shell: DIR quoted where the shell
    would split or expand it (a fleet in "my fleet" printed `--dir my fleet`, two arguments
    once pasted)."""
    return shlex.join(["edgefl", "fleet", action, "--dir", directory])


def _shown(path: str) -> str:
    """A path as a command line to copy shows it: relative to the working directory when it
    lies below it, else absolute."""
    if not os.path.isabs(path):
        return path
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with the
    pid, it names one process, so a pid the kernel reused is not taken for ours. None: no such
    process, or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _alive(proc: dict) -> bool:
    pid = proc.get("pid")
    if not pid:
        return False
    try:
        os.waitpid(pid, os.WNOHANG)         # reap it if it is our child and has exited
    except ChildProcessError:
        pass
    return _start_time(pid) == proc.get("start")


def _spawn(fleet: Fleet, service: FleetService) -> dict:
    import subprocess

    log_path = fleet.path("logs", f"{service.name}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "ab") as log:
        # a session of its own: Ctrl-C in the terminal that ran `fleet up` does not reach it,
        # and it outlives `fleet up`
        proc = subprocess.Popen(service.argv, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, cwd=service.cwd or fleet.directory,
                                start_new_session=True)
    entry = {"pid": proc.pid, "start": _start_time(proc.pid), "argv": service.argv,
             "log": log_path}
    fleet.processes[service.name] = entry
    fleet.save()
    return entry


def _log_tail(path: str, lines: int = 12) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return "".join(fh.readlines()[-lines:]).rstrip() or "(empty)"
    except OSError:
        return "(no log)"


def _edgefl(*args: str) -> list:
    # the interpreter running this, so the services import the same edgefl
    return [sys.executable, "-m", "edgefl.cli", *args]


def _services(fleet: Fleet) -> list:
    """The aggregator and the clients, as their systemd units run them, plus each client's
    data: its shard of digits.yaml (a real board names its own data in its site file)."""
    services = [FleetService(AGGREGATOR, _edgefl("aggregator", "--config",
                                                 fleet.path("aggregator.yaml")))]
    for shard, client in enumerate(fleet.clients):
        services.append(FleetService(client, _edgefl(
            "client", "--config", fleet.path(f"{client}.yaml"),
            "--partition", fleet.path("digits.yaml"), "--shard", str(shard))))
    return services


def running(fleet: Fleet) -> dict:
    """{name: process} of the fleet's processes that are alive."""
    return {name: p for name, p in fleet.processes.items() if _alive(p)}


def _choose_broker(directory: str) -> tuple:
    """("mosquitto", plugin path, None) or ("embedded", None, why not Mosquitto)."""
    mosquitto = find_mosquitto()
    plugin = find_dynsec_plugin() if mosquitto else None
    if mosquitto and plugin:
        return "mosquitto", plugin, None
    why = ("Mosquitto is not installed" if not mosquitto else
           "Mosquitto's dynamic security plugin (mosquitto_dynamic_security.so, Mosquitto "
           ">= 2.0) is not installed")
    if not mosquitto and not have_python_broker():
        raise FleetError(f"fleet up {directory}: no broker: neither Mosquitto (apt-get "
                         "install mosquitto) nor the embedded broker (pip install "
                         "'edgefl[broker]') is installed")
    return "embedded", None, why


def up(directory: str, clients: int | None = None, federation: str | None = None,
       extra_services=(), ready_timeout: float = READY_TIMEOUT, say=print) -> Fleet:
    """Bring the fleet in `directory` up: a new one (files written) or, where `down` left
    one, the same one again. Returns once every node is online; on a failure, stops what it
    started and raises FleetError with the failing process's log tail. say(text): progress.
    extra_services: more FleetService's started after the nodes (a dashboard)."""
    directory = os.path.abspath(directory)
    record = os.path.join(directory, FLEET_RECORD)
    restarting = os.path.exists(record)
    if restarting:
        fleet = Fleet.load(directory)
        alive = running(fleet)
        if alive:
            raise FleetError(f"a fleet is already running in {directory} ("
                             + ", ".join(f"{n} pid {p['pid']}" for n, p in alive.items())
                             + f"); `{fleet_command('down', directory)}` stops it")
        for given, recorded, option in ((clients, len(fleet.clients), "--clients"),
                                        (federation, fleet.federation, "--federation")):
            if given is not None and given != recorded:
                raise FleetError(f"{directory} holds a fleet with {option} {recorded}; "
                                 f"`fleet up` restarts it as it is: drop {option}, or use "
                                 "another --dir for another fleet")
        broker, plugin, why = _choose_broker(directory)
        if broker != fleet.broker:
            raise FleetError(f"{directory}: this fleet was made with the {fleet.broker} "
                             f"broker, and now the {broker} one would run ({why or 'found'})")
        if not _port_free(fleet.port):
            raise FleetError(f"{directory}: the fleet's port 127.0.0.1:{fleet.port} is in "
                             "use by another program; stop it, or make a new fleet in "
                             "another --dir")
        say(f"fleet up: starting the fleet in {directory} again (files kept)")
    else:
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise FleetError(f"--dir {directory}: is a file, not a directory; choose a new "
                             f"or empty directory")
        if os.path.isdir(directory) and os.listdir(directory):
            raise FleetError(f"--dir {directory}: directory is not empty and holds no fleet "
                             f"({FLEET_RECORD}); choose a new or empty directory")
        ids = client_ids(DEFAULT_CLIENTS if clients is None else clients)
        federation = DEFAULT_FEDERATION if federation is None else federation
        broker, plugin, why = _choose_broker(directory)
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:      # a parent is a file, or not writable
            raise FleetError(f"--dir {directory}: cannot make the directory: "
                             f"{exc.strerror or exc}") from None
        port = free_port()
        fleet = Fleet(directory, federation, ids, port, broker)
        _write_files(directory, federation, ids, port, plugin,
                     as_root=hasattr(os, "geteuid") and os.geteuid() == 0)
        fleet.save()
    if why:
        say(f"fleet up: {why}: the embedded broker (`edgefl broker`) runs instead; it "
            "takes any login, so the accounts in broker/ are written but not enforced")
    fleet.processes = {}
    try:
        for attempt in range(3):
            try:
                _start_broker(fleet)
                break
            except FleetError as exc:
                # a new fleet's free port can be taken between free_port() and the broker's
                # bind (another program on this machine); its files are ours to rewrite
                if restarting or attempt == 2 or "in use" not in str(exc):
                    raise
                _stop_all(fleet, say=lambda text: None)
                fleet.processes = {}
                fleet.port = free_port()
                _write_port_files(directory, fleet.federation, fleet.clients, fleet.port,
                                  plugin, as_root=hasattr(os, "geteuid") and os.geteuid() == 0)
                fleet.save()
        for service in _services(fleet):
            _spawn(fleet, service)
        _wait_online(fleet, ready_timeout)
        for service in extra_services:
            _spawn(fleet, service)
    except BaseException:
        _stop_all(fleet, say=lambda text: None)
        raise
    return fleet


def _port_free(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _start_broker(fleet: Fleet) -> None:
    if fleet.broker == "mosquitto":
        service = FleetService("broker", [find_mosquitto(), "-c", "mosquitto.conf"],
                               cwd=fleet.path("broker"))
    else:
        service = FleetService("broker", _edgefl("broker", "--port", str(fleet.port)))
    proc = _spawn(fleet, service)
    deadline = time.monotonic() + 30.0
    while not probe("127.0.0.1", fleet.port, timeout=0.5, any_answer=True):
        if not _alive(proc) or time.monotonic() > deadline:
            raise FleetError(f"the broker did not start on 127.0.0.1:{fleet.port} "
                             f"({proc['log']}):\n{_log_tail(proc['log'])}")
        time.sleep(0.05)


def operator_transport(fleet: Fleet, name: str = "fleet"):
    """An unconnected MQTT connection to the fleet's broker as the operator (a fresh client
    id: operator tools are not bound to one)."""
    from .transport.mqtt import MqttTransport

    return MqttTransport(fleet.url, f"edgefl-{name}-{os.getpid()}-{os.urandom(3).hex()}",
                         username=OPERATOR, clean_session=True,
                         password_file=fleet.path(CREDENTIALS_DIR, f"{OPERATOR}.pw"))


def _wait_online(fleet: Fleet, timeout: float) -> None:
    from .service.status import collect_statuses

    nodes = [AGGREGATOR, *fleet.clients]
    transport = operator_transport(fleet, "fleet-up")
    transport.connect()
    try:
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in fleet.processes.items():
                if not _alive(proc):
                    raise FleetError(f"{name} exited while the fleet was starting "
                                     f"({proc['log']}):\n{_log_tail(proc['log'])}")
            statuses = collect_statuses(transport, fleet.federation, wait=1.0)
            waiting = [n for n in nodes if (statuses.get(n) or {}).get("online") is not True]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise FleetError(f"not online after {timeout:g} s: {', '.join(waiting)} "
                                 f"(logs in {fleet.path('logs')})")
            time.sleep(0.3)
    finally:
        transport.close(timeout=1.0, announce_offline=False)


def fleet_status(directory: str, wait: float = 2.0) -> tuple:
    """(fleet, {name: alive}, {node: status} or None when the broker is not running)."""
    from .service.status import collect_statuses

    fleet = Fleet.load(os.path.abspath(directory))
    alive = {name: _alive(p) for name, p in fleet.processes.items()}
    statuses = None
    if alive.get("broker"):
        transport = operator_transport(fleet, "fleet-status")
        transport.connect()
        try:
            statuses = collect_statuses(transport, fleet.federation, wait)
        finally:
            transport.close(timeout=1.0, announce_offline=False)
    return fleet, alive, statuses


def _stop_all(fleet: Fleet, timeout: float = STOP_TIMEOUT, say=print) -> list:
    """SIGTERM the clients (and extra services), then the aggregator, then the broker (so the
    nodes' offline statuses reach it and it saves them), each group waited for; a process
    still alive after `timeout` gets SIGKILL. Returns the names stopped."""
    names = list(fleet.processes)
    first = [n for n in names if n not in (AGGREGATOR, "broker")]
    stopped = []
    for group in (first, [n for n in names if n == AGGREGATOR],
                  [n for n in names if n == "broker"]):
        live = {n: fleet.processes[n] for n in group if _alive(fleet.processes[n])}
        for name, proc in live.items():
            try:
                os.kill(proc["pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        for name, proc in live.items():
            while _alive(proc) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(proc):
                say(f"fleet down: {name} (pid {proc['pid']}) did not stop within "
                    f"{timeout:g} s of SIGTERM; killed (see {proc['log']})")
                try:
                    os.kill(proc["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
            stopped.append(name)
    fleet.save()
    return stopped


def down(directory: str, timeout: float = STOP_TIMEOUT, say=print) -> list:
    """Stop the fleet's processes (files kept); the names stopped, [] when none ran."""
    fleet = Fleet.load(os.path.abspath(directory))
    if not running(fleet):
        return []
    return _stop_all(fleet, timeout, say)

