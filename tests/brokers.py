"""Broker fixtures for the transport tests: every broker edgefl must work with, started on a
free port on 127.0.0.1 and stopped afterwards, behind one `Backend` interface so the same
test runs against each:

    loopback            edgefl.transport.loopback (in-process)
    mosquitto           `mosquitto -c` with the repo's broker/mosquitto.conf, adapted for a
                        test (one plain listener on a free port, persistence in a temp dir,
                        anonymous -- or the repo's ACL with generated passwords)
                        by edgefl.transport.broker.adapt_mosquitto_conf
    embedded-mosquitto  EmbeddedBroker(kind="mosquitto")
    embedded-python     EmbeddedBroker(kind="python") (amqtt; skipped if not installed)
    nats                our own `nats-server` with JetStream and an MQTT listener (a
                        clusterable broker); skipped if nats-server is not installed
    rabbitmq            RabbitMQ's MQTT plugin, only when EDGEFL_TEST_RABBITMQ_URL names one
                        (enabling the plugin reconfigures the system service, so the tests
                        never do it themselves)

Use them from a test module with `pytest_plugins = ["brokers"]` (pytest puts tests/ on
sys.path); the parametrized fixture `any_broker` runs a test once per broker.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from edgefl.transport.base import ConnectionEvent, Message, Transport
from edgefl.transport.broker import (EmbeddedBroker, adapt_mosquitto_conf, find_mosquitto,
                                     free_port, have_python_broker, probe)
from edgefl.transport.loopback import LoopbackBroker

REPO = Path(__file__).resolve().parents[1]
MOSQUITTO_CONF = REPO / "broker" / "mosquitto.conf"
MOSQUITTO_ACL = REPO / "broker" / "acl"

# "mosquitto-netloop": the same Mosquitto, every transport served by one shared NetworkLoop
# (as `edgefl simulate --transport mqtt` runs them) instead of a network thread each
BACKENDS = ["loopback", "mosquitto", "mosquitto-netloop", "embedded-mosquitto",
            "embedded-python", "nats", "rabbitmq"]

START_TIMEOUT = 10.0


# ---------------------------------------------------------------------------------------
# Waiting helpers (tests never sleep blindly for a message)
# ---------------------------------------------------------------------------------------

def next_message(transport: Transport, timeout: float = 5.0) -> Message:
    """The next Message (connection events skipped); fails the test after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        item = transport.receive(max(0.0, remaining)) if remaining > 0 else None
        if item is None:
            pytest.fail(f"{transport!r}: no message within {timeout:g} s")
        if isinstance(item, Message):
            return item


def messages_within(transport: Transport, seconds: float) -> list[Message]:
    """Every Message that arrives within `seconds` (for asserting that something did not)."""
    deadline = time.monotonic() + seconds
    got = []
    while (remaining := deadline - time.monotonic()) > 0:
        item = transport.receive(remaining)
        if isinstance(item, Message):
            got.append(item)
    return got


def wait_event(transport: Transport, state: str, timeout: float = 5.0) -> ConnectionEvent:
    """Skip items until a ConnectionEvent with `state`; messages seen on the way are kept in
    `transport.skipped` for the test to inspect."""
    deadline = time.monotonic() + timeout
    skipped = transport.__dict__.setdefault("skipped", [])
    while (remaining := deadline - time.monotonic()) > 0:
        item = transport.receive(remaining)
        if isinstance(item, ConnectionEvent) and item.state == state:
            return item
        if isinstance(item, Message):
            skipped.append(item)
    pytest.fail(f"{transport!r}: no {state!r} event within {timeout:g} s")


# ---------------------------------------------------------------------------------------
# Broker processes
# ---------------------------------------------------------------------------------------

class ServerProcess:
    """A broker binary on a fixed port, restartable (same port, same state directory)."""

    name = "server"

    def __init__(self, workdir: Path, port: int | None = None):
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / f"{self.name}.log"

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        return probe("127.0.0.1", self.port, timeout=0.5, any_answer=True)

    def start(self) -> None:
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)
        finally:
            log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} on 127.0.0.1:{self.port} did not start: "
                                   f"{self.log_tail()}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-lines:])
        except OSError:
            return "(no log)"

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"


class MosquittoProcess(ServerProcess):
    name = "mosquitto"

    def __init__(self, workdir: Path, users: dict[str, str] | None = None, acl: bool = False):
        super().__init__(workdir)
        self.conf_path = self.workdir / "mosquitto.conf"
        password_file = None
        if users:
            password_file = self.workdir / "passwords"
            password_file.write_text("".join(f"{u}:{p}\n" for u, p in users.items()))
            passwd = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
            subprocess.run([passwd, "-U", str(password_file)], check=True, timeout=10)
        acl_file = MOSQUITTO_ACL if acl else None
        self.conf_path.write_text(adapt_mosquitto_conf(MOSQUITTO_CONF.read_text(), self.port,
                                                       self.workdir, password_file, acl_file))

    def command(self) -> list[str]:
        return [find_mosquitto(), "-c", str(self.conf_path)]


class NatsProcess(ServerProcess):
    """nats-server with JetStream (where NATS keeps MQTT sessions and retained messages) and
    an MQTT listener; its NATS client port is free too, so the system service on 4222 is
    untouched."""

    name = "nats"

    def __init__(self, workdir: Path, max_payload_mb: int = 16):
        super().__init__(workdir)
        self.nats_port = free_port()
        self.conf_path = self.workdir / "nats.conf"
        self.conf_path.write_text(
            f'server_name: "edgefl-test-{self.port}"\n'
            f"listen: 127.0.0.1:{self.nats_port}\n"
            # NATS's default message limit is 1 MB; MQTT payloads ride on NATS messages.
            f"max_payload: {max_payload_mb}MB\n"
            f"max_pending: {4 * max_payload_mb}MB\n"
            "jetstream {\n"
            f'  store_dir: "{self.workdir / "jetstream"}"\n'
            "  max_memory_store: 256MB\n"
            "  max_file_store: 1GB\n"
            "}\n"
            f"mqtt {{\n  listen: 127.0.0.1:{self.port}\n}}\n")

    def command(self) -> list[str]:
        return [shutil.which("nats-server") or "/usr/sbin/nats-server", "-c",
                str(self.conf_path)]


def find_nats_server() -> str | None:
    found = shutil.which("nats-server")
    if found:
        return found
    return "/usr/sbin/nats-server" if os.access("/usr/sbin/nats-server", os.X_OK) else None


def rabbitmq_skip_reason() -> str:
    if not (shutil.which("rabbitmq-plugins") or os.path.exists("/usr/sbin/rabbitmq-plugins")):
        return "RabbitMQ is not installed; set EDGEFL_TEST_RABBITMQ_URL to test one elsewhere"
    try:
        enabled = Path("/etc/rabbitmq/enabled_plugins").read_text()
    except OSError:
        enabled = ""
    if "rabbitmq_mqtt" not in enabled:
        return ("RabbitMQ is installed but its MQTT plugin is not enabled (`rabbitmq-plugins "
                "enable rabbitmq_mqtt` reconfigures the system service, so the tests leave it "
                "alone); enable it and set EDGEFL_TEST_RABBITMQ_URL=mqtt://user:pass@127.0.0.1:"
                "PORT to run these tests against it")
    return ("RabbitMQ's MQTT plugin is enabled: set EDGEFL_TEST_RABBITMQ_URL=mqtt://user:pass@"
            "127.0.0.1:PORT (its listener and credentials) to run these tests against it")


# ---------------------------------------------------------------------------------------
# One interface over all of them
# ---------------------------------------------------------------------------------------

class Backend:
    """Makes transports to one broker and (where the test owns the broker) stops and starts
    it. Topics and client ids are unique per test, so tests sharing a broker never meet."""

    def __init__(self, name: str, url: str | None = None, loopback: LoopbackBroker | None = None,
                 server=None, mqtt5: bool = False, packet_limit: int | None = None,
                 network_loop=None):
        self.name = name
        self.network_loop = network_loop   # a NetworkLoop every MQTT transport shares, or None
        self.url = url
        self.loopback = loopback
        self.server = server               # has stop()/start(), or None (not ours)
        self.mqtt5 = mqtt5
        self.packet_limit = packet_limit   # the broker's packet size limit, if any
        self.uid = uuid.uuid4().hex[:8]
        self._made: list[Transport] = []

    def topic(self, suffix: str) -> str:
        return f"edgefl-test/{self.uid}/{suffix}"

    def client_id(self, role: str) -> str:
        return f"{role}-{self.uid}"

    def transport(self, role: str = "node", **options) -> Transport:
        """An unconnected transport; tests default to clean sessions so nothing lingers on a
        shared broker (pass clean_session=False for the persistent-session tests)."""
        options.setdefault("clean_session", True)
        cid = options.pop("client_id", None) or self.client_id(role)
        if self.loopback is not None:
            transport = self.loopback.transport(cid, **options)
        else:
            from edgefl.transport.mqtt import MqttTransport
            settings = dict(reconnect_min=0.05, reconnect_max=0.5, connect_timeout=5.0,
                            publish_timeout=10.0)
            settings.update(options)
            transport = MqttTransport(self.url, cid, network_loop=self.network_loop, **settings)
        self._made.append(transport)
        return transport

    def connected(self, role: str = "node", **options) -> Transport:
        transport = self.transport(role, **options)
        transport.connect()
        return transport

    @property
    def restartable(self) -> bool:
        return self.loopback is not None or self.server is not None

    def stop(self) -> None:
        if self.loopback is not None:
            self.loopback.stop()
        else:
            self.server.stop()

    def start(self) -> None:
        if self.loopback is not None:
            self.loopback.start()
        else:
            self.server.start()

    def close_all(self) -> None:
        for transport in self._made:
            try:
                transport.close(timeout=1.0, announce_offline=False)
            except Exception:            # noqa: BLE001 -- teardown of a failed test
                transport.kill()
        self._made.clear()
        if self.network_loop is not None:
            assert self.network_loop.clients == 0, "a transport left on the network loop"
            self.network_loop.close()


# ---------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------

def _require_mosquitto() -> None:
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto; .ci/run installs "
                    "it)")


@pytest.fixture(scope="module")
def mosquitto_server(tmp_path_factory):
    """The repo's broker/mosquitto.conf, anonymous, on a free port."""
    _require_mosquitto()
    server = MosquittoProcess(tmp_path_factory.mktemp("mosquitto"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mosquitto_acl_server(tmp_path_factory):
    """The repo's config with its ACL (broker/acl) and generated per-node passwords."""
    _require_mosquitto()
    if not (shutil.which("mosquitto_passwd") or os.path.exists("/usr/bin/mosquitto_passwd")):
        pytest.skip("mosquitto_passwd is not installed (package mosquitto)")
    users = {"aggregator": "agg-secret", "operator": "op-secret",
             "client-1": "c1-secret", "client-2": "c2-secret"}
    server = MosquittoProcess(tmp_path_factory.mktemp("mosquitto-acl"), users=users, acl=True)
    server.users = users
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def embedded_mosquitto():
    _require_mosquitto()
    with EmbeddedBroker(kind="mosquitto", max_packet_bytes=32 << 20) as broker:
        yield broker


@pytest.fixture(scope="module")
def embedded_python():
    if not have_python_broker():
        pytest.skip("the pure-Python broker amqtt is not installed (pip install "
                    "'edgefl[broker]'; needs Python >= 3.10)")
    with EmbeddedBroker(kind="python") as broker:
        yield broker


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory):
    if find_nats_server() is None:
        pytest.skip("nats-server is not installed (Debian: apt-get install nats-server); it is "
                    "the second, clusterable broker these tests use")
    server = NatsProcess(tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=BACKENDS)
def any_broker(request):
    """A Backend for each broker kind; the same test body runs against every one."""
    name = request.param
    if name == "loopback":
        b = Backend(name, loopback=LoopbackBroker())
    elif name == "mosquitto":
        server = request.getfixturevalue("mosquitto_server")
        b = Backend(name, url=server.url, server=server, mqtt5=True,
                    packet_limit=_conf_packet_limit())
    elif name == "mosquitto-netloop":
        from edgefl.transport.netloop import NetworkLoop
        server = request.getfixturevalue("mosquitto_server")
        b = Backend(name, url=server.url, server=server, mqtt5=True,
                    packet_limit=_conf_packet_limit(), network_loop=NetworkLoop())
    elif name == "embedded-mosquitto":
        broker = request.getfixturevalue("embedded_mosquitto")
        b = Backend(name, url=broker.url, server=broker, mqtt5=True,
                    packet_limit=broker.max_packet_bytes)
    elif name == "embedded-python":
        broker = request.getfixturevalue("embedded_python")
        b = Backend(name, url=broker.url, server=broker)
    elif name == "nats":
        server = request.getfixturevalue("nats_server")
        b = Backend(name, url=server.url, server=server)
    elif name == "rabbitmq":
        url = os.environ.get("EDGEFL_TEST_RABBITMQ_URL")
        if not url:
            pytest.skip(rabbitmq_skip_reason())
        b = Backend(name, url=url)
    else:
        raise AssertionError(name)
    yield b
    b.close_all()


def _conf_packet_limit() -> int | None:
    match = re.search(r"^max_packet_size\s+(\d+)", MOSQUITTO_CONF.read_text(), re.M)
    return int(match.group(1)) if match else None


__all__ = ["any_broker", "mosquitto_server", "mosquitto_acl_server", "embedded_mosquitto",
           "embedded_python", "nats_server", "Backend", "next_message", "messages_within",
           "wait_event", "MosquittoProcess", "NatsProcess", "adapt_mosquitto_conf",
           "BACKENDS"]
