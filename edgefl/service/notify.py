"""systemd's sd_notify protocol over `NOTIFY_SOCKET`, without libsystemd or a new dependency.

A unit with `Type=notify` waits for READY=1 before it counts the service as started, shows
STATUS= in `systemctl status`, and with `WatchdogSec=` restarts a service that stops sending
WATCHDOG=1. The protocol (sd_notify(3)) is one AF_UNIX datagram of newline-separated
`KEY=value` lines sent to the socket named by `NOTIFY_SOCKET`; a leading '@' names a socket in
the abstract namespace. Outside systemd (NOTIFY_SOCKET unset) every call is a no-op that
returns False, so the roles call it unconditionally.

    notifier = Notifier.from_environment()
    notifier.ready("client pi-07: waiting for round 1")
    with notifier.watchdog_pinger(healthy=notifier.heartbeat_check()):
        while not stop.is_set():
            notifier.beat()                  # once per pass of the main loop
            ...
            notifier.status("round 3: training")
    notifier.stopping()

The watchdog pings come from a thread, so by themselves they only prove the interpreter is
alive. The main loop's heartbeat makes them mean more: the loop calls beat() on every pass
(waiting on its queue with a timeout, so it also beats while idle), and the pinger's
heartbeat_check() skips the pings once the last beat is older than half the watchdog timeout;
systemd then restarts a service whose main loop is stuck (WatchdogSec= to 1.5 x WatchdogSec=
after the last beat). So one step that keeps the loop from beating for more than half of
WatchdogSec= (a very slow evaluation, say) may get the service restarted: such a service
needs a larger WatchdogSec=.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable

__all__ = ["Notifier", "WatchdogPinger", "watchdog_interval"]

log = logging.getLogger("edgefl.service.notify")


def watchdog_interval(environ=None) -> float | None:
    """The watchdog timeout systemd set for this process (`WATCHDOG_USEC`, in seconds), or
    None when there is none, or when `WATCHDOG_PID` names another process (the variable was
    inherited from a parent that systemd watches)."""
    environ = os.environ if environ is None else environ
    usec = environ.get("WATCHDOG_USEC", "").strip()
    if not usec:
        return None
    pid = environ.get("WATCHDOG_PID", "").strip()
    if pid and pid != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("WATCHDOG_USEC=%r is not an integer; no watchdog pings", usec)
        return None
    return value / 1e6 if value > 0 else None


class Notifier:
    """Sends sd_notify messages to one socket; thread-safe (one datagram per call)."""

    def __init__(self, address: str | None):
        self.address = address or None
        self._socket_address: str | bytes | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._warned = False
        self._ready_sent = False
        self._status: str | None = None    # the last STATUS sent
        # monotonic time of the main loop's last beat(); None: start-up (before READY=1)
        self.last_beat: float | None = None
        if self.address is None:
            return
        if self.address.startswith("@"):
            # abstract namespace: the name starts with a NUL byte instead of '@'
            self._socket_address = b"\0" + self.address[1:].encode()
        elif self.address.startswith("/"):
            self._socket_address = self.address
        else:
            # systemd >= 253 may hand out vsock: addresses (VMs); a board service never gets one
            log.warning("NOTIFY_SOCKET=%r is neither a path nor an abstract socket ('@name'); "
                        "sd_notify disabled", self.address)
            self.address = None

    @classmethod
    def from_environment(cls, environ=None) -> "Notifier":
        """The notifier systemd set up for this process (NOTIFY_SOCKET), or a no-op one."""
        environ = os.environ if environ is None else environ
        return cls(environ.get("NOTIFY_SOCKET"))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields) -> bool:
        """Send KEY=value lines in one datagram (send(READY=1, STATUS="x")). Returns True when
        sent, False when disabled or the send failed (logged once: a missing notification must
        not stop the service; systemd acts on the silence itself)."""
        if not self.enabled or not fields:
            return False
        lines = []
        for key, value in fields.items():
            # a newline would start another assignment; STATUS texts come from our own code
            text = str(value).replace("\n", " ")
            lines.append(f"{key}={text}")
        payload = "\n".join(lines).encode("utf-8")
        if "STATUS" in fields:
            self._status = str(fields["STATUS"]).replace("\n", " ")
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX,
                                               socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                # non-blocking, as libsystemd's sd_notify: a reader that stopped reading must
                # not stall the service (the notification is dropped, logged once)
                self._sock.sendto(payload, socket.MSG_DONTWAIT, self._socket_address)
            except OSError as exc:
                if not self._warned:
                    log.warning("sd_notify to %s failed: %s", self.address, exc)
                    self._warned = True
                return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """READY=1: start-up is done (config read, state loaded, broker connected). Sent once
        per process: a later call (the aggregator daemon's READY, then each of its runs
        starting) sends only its STATUS. Counts as the main loop's first beat()."""
        self.beat()
        if self._ready_sent:
            return self.status(status) if status is not None else False
        sent = self.send(READY=1, **({"STATUS": status} if status is not None else {}))
        self._ready_sent = sent
        return sent

    def status(self, text: str) -> bool:
        """STATUS=text: one line shown by `systemctl status`, e.g. "round 12: training".
        The same text as the last STATUS is not sent again: a loop that reports its state on
        every pass (the idle aggregator service, twice a second) would flood the manager
        with datagrams that change nothing."""
        if self.enabled and text.replace("\n", " ") == self._status:
            return True
        return self.send(STATUS=text)

    def stopping(self, status: str | None = None) -> bool:
        """STOPPING=1: shutdown has begun (a stop signal arrived)."""
        return self.send(STOPPING=1, **({"STATUS": status} if status is not None else {}))

    def beat(self) -> None:
        """The main loop is alive: record the time (monotonic). A role calls it on every pass
        of its main loop; heartbeat_check() turns the beats into the watchdog's health check.
        Cheap (no system call, no lock: one float assignment), and a no-op in effect outside
        systemd."""
        self.last_beat = time.monotonic()

    def heartbeat_check(self, max_age: float | None = None,
                        environ=None) -> Callable[[], bool]:
        """A `healthy` check for watchdog_pinger: True during start-up (before READY=1, which
        systemd's watchdog waits for; TimeoutStartSec= covers start-up), then while the main
        loop's last beat() is less than `max_age` seconds old. max_age defaults to half the
        watchdog timeout (WATCHDOG_USEC), the ping interval; with no watchdog the check
        always passes (no pings are sent anyway)."""
        if max_age is None:
            timeout = watchdog_interval(environ)
            max_age = timeout / 2 if timeout else None
        if max_age is not None and not max_age > 0:
            raise ValueError(f"heartbeat max_age {max_age!r}: must be > 0 seconds")

        stuck = [False]             # warned about this stall already

        def healthy() -> bool:
            last = self.last_beat
            if last is None or max_age is None:
                return True
            age = time.monotonic() - last
            if age < max_age:
                if stuck[0]:
                    log.warning("main loop running again; watchdog pings resumed")
                    stuck[0] = False
                return True
            if not stuck[0]:
                log.warning("main loop has not run for %.1f s (limit %.1f s): watchdog pings "
                            "withheld, systemd restarts the service unless it recovers", age,
                            max_age)
                stuck[0] = True
            return False
        return healthy

    def watchdog(self) -> bool:
        """WATCHDOG=1: one keep-alive ping."""
        return self.send(WATCHDOG=1)

    def extend_timeout(self, seconds: float) -> bool:
        """EXTEND_TIMEOUT_USEC: ask for `seconds` more before the start (or stop) times out,
        e.g. while a slow board loads its data."""
        return self.send(EXTEND_TIMEOUT_USEC=max(1, int(seconds * 1e6)))

    def watchdog_pinger(self, healthy: Callable[[], bool] | None = None,
                        interval: float | None = None, environ=None) -> "WatchdogPinger":
        """A WatchdogPinger (not started; use it as a context manager or call start()).
        interval: seconds between pings; default half of WATCHDOG_USEC, as sd_watchdog_enabled(3)
        advises."""
        if interval is None:
            timeout = watchdog_interval(environ)
            interval = timeout / 2 if timeout else None
        return WatchdogPinger(self, interval, healthy)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


class WatchdogPinger:
    """Sends WATCHDOG=1 every `interval` seconds from a daemon thread until stop().

    healthy: called before each ping; a False return (or an exception, logged) skips the ping,
    so systemd restarts a process whose main loop is stuck even though this thread still
    runs. Without it the pings only prove the interpreter is alive; the roles pass
    Notifier.heartbeat_check() (their main loops call Notifier.beat()). A pinger with no interval
    (no watchdog configured) or a disabled notifier starts no thread.
    """

    def __init__(self, notifier: Notifier, interval: float | None,
                 healthy: Callable[[], bool] | None = None):
        if interval is not None and not interval > 0:
            raise ValueError(f"watchdog interval {interval!r}: must be > 0 seconds")
        self.notifier = notifier
        self.interval = interval
        self.healthy = healthy
        self.pings = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "WatchdogPinger":
        if self._thread is not None or self.interval is None or not self.notifier.enabled:
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="edgefl-watchdog", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            if self._is_healthy() and self.notifier.watchdog():
                self.pings += 1
            if self._stop.wait(self.interval):
                return

    def _is_healthy(self) -> bool:
        if self.healthy is None:
            return True
        try:
            return bool(self.healthy())
        except Exception:  # noqa: BLE001  (a broken check must skip the ping, not kill the thread)
            log.exception("watchdog health check failed; not pinging")
            return False

    def stop(self, timeout: float = 5.0) -> None:
        """Stop pinging and join the thread (no ping is sent after this returns)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("watchdog thread did not stop within %.1f s", timeout)
            self._thread = None

    def __enter__(self) -> "WatchdogPinger":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
