"""`EmbeddedBroker`: a local MQTT broker for zero-setup runs (`edgefl simulate --transport
mqtt` without --broker, `edgefl broker`, tests).

Two implementations behind one context manager:

- "mosquitto": the `mosquitto` binary (Debian/Ubuntu/Raspberry Pi OS package `mosquitto`)
  started as a child process with a generated config on a free port: listener on 127.0.0.1,
  `set_tcp_nodelay true`, `max_packet_size` from `max_packet_bytes`, `persistence false`.
- "python": amqtt, a pure-Python asyncio broker from PyPI (`pip install 'edgefl[broker]'`),
  run on an event loop in a background thread of this process. MQTT 3.1.1 only, and it
  does not enforce `max_packet_bytes`.

"auto" prefers Mosquitto when it is installed: it is the broker production runs on, it
speaks MQTT 5 too, and it moves QoS 1 traffic several times faster with a lower round-trip
time (docs/brokers.md has the measurements and the reasoning).

    with EmbeddedBroker(max_packet_bytes=16 << 20) as broker:
        transport = MqttTransport(broker.url, "aggregator")

The broker is ready when `start()` returns: an MQTT CONNECT to it has been accepted.

`adapt_mosquitto_conf` is the other way to run a local Mosquitto: the production config
(broker/mosquitto.conf) with only its listeners and paths replaced, for the tests and the
chaos soak (tools/chaos.py), which must run against the options production runs with.
"""
from __future__ import annotations

import ctypes
import errno
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["EmbeddedBroker", "BrokerError", "find_mosquitto", "have_python_broker",
           "free_port", "probe", "mosquitto_config", "adapt_mosquitto_conf", "packet_bytes_for",
           "KINDS", "DEFAULT_MAX_PACKET_BYTES"]

KINDS = ("auto", "mosquitto", "python")

# 64 MiB: a 16M-parameter float32 model in one frame. Size it to the largest frame a run
# sends (`packet_bytes_for`); chunked transfers need only the chunk size.
DEFAULT_MAX_PACKET_BYTES = 64 << 20
_PACKET_HEADROOM = 64 << 10     # topic, MQTT headers, frame header and JSON metadata


_PR_SET_PDEATHSIG = 1


def _ends_with_this_process(binary: str, conf: str, port: int):
    """A preexec_fn that has Linux send the child SIGTERM when this process dies, or None
    where that cannot be promised. The embedded Mosquitto runs in a session of its own (see
    _start_mosquitto), so a kill -9 of the run, or of its process group, would otherwise
    leave it listening for ever. Linux sends the signal when the *thread* that forked the
    child ends, so only a broker started from the main thread gets it (the main thread
    outlives every other one of the process).

    Linux also forgets the signal when the process changes its user, and Mosquitto started
    as root changes to the `mosquitto` user. So when this process is root the child changes
    to that user itself, before asking for the signal (Mosquitto then has nothing to drop),
    and the generated config (no secret in it) and its directory become readable to it.
    Only where that user can reach both `binary` and `conf` (not under a private
    directory such as /root or a TMPDIR of mode 0700), and not below port 1024, which only
    root may listen on: otherwise Mosquitto changes user itself, as before, and the signal
    is lost."""
    if not sys.platform.startswith("linux") or \
            threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None).prctl          # looked up here: the child only calls it
    except (OSError, AttributeError):
        return None
    prctl.argtypes = (ctypes.c_int, ctypes.c_ulong)
    parent = os.getpid()
    user = None
    if os.geteuid() == 0:
        import pwd
        try:
            entry = pwd.getpwnam("mosquitto")
        except KeyError:
            entry = None                         # Mosquitto stays root: nothing to forget
        if entry is not None:
            workdir = os.path.dirname(conf)
            if port < 1024 or not _open_to_others(os.path.dirname(os.path.realpath(binary))) \
                    or not os.stat(os.path.realpath(binary)).st_mode & 0o001 \
                    or not _open_to_others(os.path.dirname(workdir)):
                return None
            os.chmod(workdir, 0o755)
            os.chmod(conf, 0o644)                # whatever the umask made it
            user = (entry.pw_uid, entry.pw_gid)

    def in_child() -> None:
        if user is not None:
            os.setgroups([])
            os.setgid(user[1])
            os.setuid(user[0])
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:               # died between the fork and the prctl
            os._exit(1)
    return in_child


def _open_to_others(directory: str) -> bool:
    """Whether any user may pass through `directory` and every directory above it."""
    path = os.path.realpath(directory)
    while True:
        if not os.stat(path).st_mode & 0o001:
            return False
        up = os.path.dirname(path)
        if up == path:
            return True
        path = up


class BrokerError(OSError):
    """The embedded broker cannot be started (not installed, port taken, crashed)."""


def packet_bytes_for(payload_bytes: int) -> int:
    """A broker packet-size limit that fits a frame of `payload_bytes` with headroom for the
    topic, MQTT headers and the frame's own header and metadata."""
    return int(payload_bytes) + _PACKET_HEADROOM


def find_mosquitto() -> str | None:
    """The mosquitto binary: $EDGEFL_MOSQUITTO when set (a path; "none" or empty: act as if
    Mosquitto were not installed, as the tests of the fallbacks do), else on PATH, or in the
    sbin directories Debian installs it to (which an ordinary user's PATH often lacks)."""
    override = os.environ.get("EDGEFL_MOSQUITTO")
    if override is not None:
        return override if override not in ("", "none") and os.access(override, os.X_OK) \
            else None
    found = shutil.which("mosquitto")
    if found:
        return found
    for candidate in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def have_python_broker() -> bool:
    return sys.version_info >= (3, 10) and importlib.util.find_spec("amqtt") is not None


def listen_error(exc: OSError, host: str, port: int, server: str) -> OSError:
    """The error of a failed bind in words naming the address and the option to change
    (--host, --port), with the errno kept (the CLI prints the message alone). `server`
    names what was to listen ("dashboard", "broker"). A host that is no address ("Name or
    service not known") is named too."""
    texts = {
        errno.EADDRINUSE: f"port {port} on {host} is in use (another {server}, or another "
                          f"server?): choose another with --port",
        errno.EADDRNOTAVAIL: f"cannot listen on {host}: not an address of this machine "
                             f"(--host)",
        errno.EACCES: f"port {port} on {host}: permission denied (ports below 1024 need "
                      f"root): choose another with --port",
    }
    if isinstance(exc, socket.gaierror):
        text = f"cannot listen on {host}: {exc.strerror or exc} (--host)"
    else:
        text = texts.get(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}")
    error = OSError(text)
    error.errno = exc.errno
    return error


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel's choice for port 0); OSError
    naming the host when it cannot be listened on (listen_error)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, 0))
        except OSError as exc:
            raise listen_error(exc, host, 0, "broker") from None
        return sock.getsockname()[1]


def _port_is_free(host: str, port: int) -> bool:
    """Nobody listens on host:port (a socket in TIME_WAIT does not count, as for the broker,
    which binds with SO_REUSEADDR). A host that cannot be listened on at all (no such name,
    not this machine's address) is OSError naming it, not a port in use."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise listen_error(exc, host, port, "broker") from None
        return True


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def probe(host: str, port: int, timeout: float = 1.0, client_id: str | None = None,
          any_answer: bool = False) -> bool:
    """True if an MQTT 3.1.1 broker at host:port accepts an anonymous CONNECT (CONNACK code
    0; with `any_answer`, any CONNACK, e.g. "not authorised" from a broker that requires
    credentials). A raw socket exchange: no client library, no session left behind."""
    cid = (client_id or f"edgefl-probe-{os.getpid()}-{time.monotonic_ns() % 10**9}").encode()
    variable = b"\x00\x04MQTT\x04\x02\x00\x0a"        # MQTT 3.1.1, clean session, keepalive 10
    body = variable + len(cid).to_bytes(2, "big") + cid
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"\x10" + _varint(len(body)) + body)
            connack = b""
            while len(connack) < 4:
                chunk = sock.recv(4 - len(connack))
                if not chunk:
                    return False
                connack += chunk
            if connack[0] != 0x20:
                return False
            if connack[3] == 0:
                sock.sendall(b"\xe0\x00")                # DISCONNECT: no will, no session
            return connack[3] == 0 or any_answer
    except OSError:
        return False


def mosquitto_config(port: int, host: str = "127.0.0.1",
                     max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES) -> str:
    """The generated config of the embedded Mosquitto (see broker/mosquitto.conf for the
    production one and the meaning of each option)."""
    return "\n".join([
        "# edgefl embedded broker: generated for one run, local and anonymous",
        f"listener {port} {host}",
        "allow_anonymous true",
        "persistence false",
        # Nagle's algorithm holds back small packets (PUBACKs, small publishes) for up to
        # 40 ms waiting for more data: a QoS 1 round trip goes from under 1 ms to ~45 ms.
        "set_tcp_nodelay true",
        f"max_packet_size {int(max_packet_bytes)}",
        # Per-client queue beyond the 20 in flight. Mosquitto silently drops QoS 1 messages
        # past it, and an aggregator receiving chunked updates from many clients at once
        # needs more than the default 1000.
        "max_queued_messages 100000",
        "log_dest stderr",
        "log_type error",
        "log_type warning",
        "connection_messages false",
        "",
    ])


# Options of broker/mosquitto.conf that belong to a listener (or to its access control):
# `adapt_mosquitto_conf` drops them, since TLS certificates and system paths do not exist
# where a local copy runs, and puts one listener of its own in their place.
_LISTENER_OPTIONS = {
    "listener", "protocol", "cafile", "capath", "certfile", "keyfile", "tls_version",
    "require_certificate", "use_identity_as_username", "use_subject_as_username",
    "allow_anonymous", "password_file", "acl_file", "ciphers", "psk_hint", "mount_point",
    "socket_domain", "bind_interface", "http_dir", "max_connections",
    # access control by a plugin (the dynamic security plugin's accounts): replaced too
    "plugin", "auth_plugin", "per_listener_settings",
}


def adapt_mosquitto_conf(text: str, port: int, workdir: str | os.PathLike,
                         password_file: str | os.PathLike | None = None,
                         acl_file: str | os.PathLike | None = None) -> str:
    """The production Mosquitto config `text` (broker/mosquitto.conf) adapted to run as a
    local, throw-away copy -- for the tests and the chaos soak, so that they exercise the
    global options production runs with (TCP_NODELAY, packet size, queues, persistence):

    - those global options are kept as they are; comments and blank lines are dropped;
    - every listener and its options (TLS files, access control: `_LISTENER_OPTIONS`) is
      replaced by one plain listener on 127.0.0.1:`port`, since the certificates and
      system paths the production listeners name do not exist here;
    - `persistence_location` moves into `workdir` (restarts keep the state there, and the
      system's /var/lib/mosquitto is not touched); `log_dest` becomes stderr, which the
      caller captures into its own log file;
    - access is anonymous without `password_file`; with it, only its users, restricted by
      `acl_file` when one is given;
    - started as root (a container), Mosquitto drops to user "mosquitto", which cannot
      read a private temp `workdir`: `user root` keeps it root (a local copy has nothing to
      protect).
    """
    kept = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        option = line.split()[0]
        if option in _LISTENER_OPTIONS or option.startswith(("plugin_opt_", "auth_opt_")):
            continue
        if option == "persistence_location":
            line = f"persistence_location {workdir}/"
        elif option == "log_dest":
            line = "log_dest stderr"
        kept.append(line)
    kept.append(f"listener {port} 127.0.0.1")
    if password_file is None:
        kept.append("allow_anonymous true")
    else:
        kept += ["allow_anonymous false", f"password_file {password_file}"]
        if acl_file is not None:
            kept.append(f"acl_file {acl_file}")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        kept.append("user root")
    return "\n".join(kept) + "\n"


class EmbeddedBroker:
    """A local broker for one run: `with EmbeddedBroker() as b: ... b.url ...`.

    port: 0 picks a free port. kind: "auto" (Mosquitto if installed, else amqtt),
    "mosquitto" or "python". max_packet_bytes: the largest MQTT packet the broker accepts
    (Mosquitto disconnects a client that sends more; MQTT 5 clients are told the limit).
    """

    def __init__(self, port: int = 0, kind: str = "auto",
                 max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES, host: str = "127.0.0.1",
                 startup_timeout: float = 10.0):
        if kind not in KINDS:
            raise ValueError(f"embedded broker kind {kind!r}: use one of {', '.join(KINDS)}")
        if not 20 <= max_packet_bytes <= 268_435_460:
            raise ValueError(f"max_packet_bytes={max_packet_bytes}: must be between 20 and "
                             "268435460 (the MQTT packet limit)")
        if not 0 <= port <= 65535:
            raise ValueError(f"port {port}: must be 0 (pick a free one) to 65535")
        self.requested_kind = kind
        self.kind: str | None = None
        self.host = host
        self.port = port
        self.max_packet_bytes = int(max_packet_bytes)
        self.startup_timeout = startup_timeout
        self._auto_port = port == 0
        self._dir: tempfile.TemporaryDirectory | None = None
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._thread: threading.Thread | None = None
        self._loop = None
        self._stop_event = None
        self._thread_error: BaseException | None = None

    # -- public -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        return self._thread is not None and self._thread.is_alive()

    @property
    def pid(self) -> int | None:
        """The Mosquitto child's process id (None for the in-process broker)."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> "EmbeddedBroker":
        if self.running:
            return self
        self.kind = self._resolve_kind()
        attempts = 5 if self._auto_port else 1
        for attempt in range(attempts):
            if self._auto_port and (attempt > 0 or self.port == 0):
                self.port = free_port(self.host)
            try:
                # Checked first: the readiness probe would otherwise be answered by whatever
                # broker already listens there.
                if not _port_is_free(self.host, self.port):
                    raise _PortTaken()
                if self.kind == "mosquitto":
                    self._start_mosquitto()
                else:
                    self._start_python()
                self._auto_port = False     # restarts reuse the port clients know
                return self
            except _PortTaken:
                self._cleanup()
                if attempt == attempts - 1:
                    raise BrokerError(f"embedded {self.kind} broker: port {self.host}:"
                                      f"{self.port} is already in use") from None
            except BaseException:
                self._cleanup()
                raise
        raise AssertionError("unreachable")

    def stop(self, timeout: float = 5.0) -> None:
        """Shut the broker down and wait for it; idempotent."""
        if self._proc is not None:
            proc = self._proc
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout)
        if self._thread is not None and self._loop is not None and self._stop_event is not None:
            try:
                self._loop.call_soon_threadsafe(self._stop_event.set)
            except RuntimeError:
                pass                                   # loop already closed
            self._thread.join(timeout)
        self._cleanup()

    def restart(self) -> None:
        """Stop and start again on the same port (clients see the connection drop; nothing
        is kept: no persistence)."""
        self.stop()
        self.start()

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of Mosquitto's log (empty for the in-process broker)."""
        if self._dir is None:
            return ""
        try:
            with open(os.path.join(self._dir.name, "mosquitto.log"), encoding="utf-8",
                      errors="replace") as fh:
                return "".join(fh.readlines()[-lines:]).strip()
        except OSError:
            return ""

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<EmbeddedBroker {self.kind or self.requested_kind} {self.url} {state}>"

    # -- implementations ---------------------------------------------------------------

    def _resolve_kind(self) -> str:
        kind = self.requested_kind
        if kind in ("auto", "mosquitto") and find_mosquitto():
            return "mosquitto"
        if kind == "mosquitto":
            raise BrokerError("embedded broker: `mosquitto` is not installed (Debian, "
                              "Raspberry Pi OS: apt-get install mosquitto), or use "
                              "--kind python")
        if have_python_broker():
            return "python"
        if sys.version_info < (3, 10):
            raise BrokerError("embedded broker: no `mosquitto` found, and the pure-Python "
                              "broker (amqtt) needs Python >= 3.10; install mosquitto "
                              "(apt-get install mosquitto)")
        raise BrokerError("embedded broker: neither `mosquitto` (apt-get install mosquitto) "
                          "nor the pure-Python broker (pip install 'edgefl[broker]') is "
                          "installed")

    def _start_mosquitto(self) -> None:
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="edgefl-mosquitto-")
        conf = os.path.join(self._dir.name, "mosquitto.conf")
        with open(conf, "w", encoding="utf-8") as fh:
            fh.write(mosquitto_config(self.port, self.host, self.max_packet_bytes))
        self._log = open(os.path.join(self._dir.name, "mosquitto.log"), "wb")
        # its own session: a Ctrl-C at the terminal (SIGINT to the whole foreground process
        # group) reaches the run, which stops its roles and then this broker, not the broker
        # under roles still publishing their last status; and it ends when the run dies
        binary = find_mosquitto()
        self._proc = subprocess.Popen([binary, "-c", conf], stdin=subprocess.DEVNULL,
                                      stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True,
                                      preexec_fn=_ends_with_this_process(binary, conf,
                                                                         self.port))
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self._proc.poll() is not None:
                tail = self.log_tail()
                if "in use" in tail:
                    raise _PortTaken()
                raise BrokerError(f"embedded mosquitto exited with status "
                                  f"{self._proc.returncode} on {self.host}:{self.port}: "
                                  f"{tail or 'no output'}")
            if probe(self.host, self.port, timeout=0.5):
                return
            if time.monotonic() > deadline:
                raise BrokerError(f"embedded mosquitto on {self.host}:{self.port} did not "
                                  f"accept an MQTT connection within {self.startup_timeout:g} "
                                  f"s: {self.log_tail() or 'no output'}")
            time.sleep(0.02)

    def _start_python(self) -> None:
        ready = threading.Event()
        self._thread_error = None
        self._thread = threading.Thread(target=self._run_python, args=(ready,),
                                        name=f"edgefl-amqtt-{self.port}", daemon=True)
        self._thread.start()
        if not ready.wait(self.startup_timeout):
            raise BrokerError(f"embedded amqtt broker on {self.host}:{self.port} did not "
                              f"start within {self.startup_timeout:g} s")
        if self._thread_error is not None:
            error = self._thread_error
            if isinstance(error, OSError) and error.errno in (98, 48) or "in use" in str(error):
                raise _PortTaken()
            raise BrokerError(f"embedded amqtt broker on {self.host}:{self.port}: {error}")
        deadline = time.monotonic() + self.startup_timeout
        while not probe(self.host, self.port, timeout=0.5):
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise BrokerError(f"embedded amqtt broker on {self.host}:{self.port} does "
                                  "not accept MQTT connections")
            time.sleep(0.02)

    def _run_python(self, ready: threading.Event) -> None:
        import asyncio
        import logging

        # amqtt warns about every late PUBACK under load (harmless: we checked delivery counts);
        # keep its log to errors unless the application configured it.
        amqtt_log = logging.getLogger("amqtt")
        if amqtt_log.level == logging.NOTSET:
            amqtt_log.setLevel(logging.ERROR)

        async def serve() -> None:
            from amqtt.broker import Broker

            self._loop = asyncio.get_running_loop()
            self._stop_event = asyncio.Event()
            config = {
                "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
                # Our auth plugin only: amqtt's default set adds $SYS publishing and packet
                # logging, and its AnonymousAuthPlugin disables persistent sessions.
                "plugins": {_amqtt_auth_plugin(): {}},
                "session_expiry_interval": 3600,
            }
            broker = Broker(config)
            try:
                await broker.start()
            except BaseException as exc:   # noqa: BLE001 -- reported to start()
                cause = exc.__cause__ if exc.__cause__ is not None else exc
                self._thread_error = cause
                ready.set()
                return
            ready.set()
            await self._stop_event.wait()
            await broker.shutdown()

        try:
            asyncio.run(serve())
        except BaseException as exc:       # noqa: BLE001 -- reported to start()
            self._thread_error = exc
            ready.set()

    def _cleanup(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        self._thread = None
        self._loop = None
        self._stop_event = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


class _PortTaken(Exception):
    pass


def _amqtt_auth_plugin() -> str:
    """Dotted path of an amqtt auth plugin that accepts every client as a named session.
    amqtt treats clients admitted by its AnonymousAuthPlugin as anonymous, and for those it
    neither keeps a persistent session nor queues QoS 1 messages while they are offline --
    the behaviour edgefl relies on (and Mosquitto has). Defined on first use, so importing
    this module does not import amqtt."""
    if "_AmqttLocalAuth" not in globals():
        from dataclasses import dataclass

        from amqtt.plugins.base import BaseAuthPlugin

        class _AmqttLocalAuth(BaseAuthPlugin):
            async def authenticate(self, *, session) -> bool:
                return True

            @dataclass
            class Config:
                pass

        _AmqttLocalAuth.__module__ = __name__
        globals()["_AmqttLocalAuth"] = _AmqttLocalAuth
    return f"{__name__}._AmqttLocalAuth"
