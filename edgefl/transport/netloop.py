"""`NetworkLoop`: one network thread for many MqttTransports of one process.

    loop = NetworkLoop()
    a = MqttTransport(url, "client-0", network_loop=loop)
    b = MqttTransport(url, "client-1", network_loop=loop)
    ...
    loop.close()                 # after the transports are closed

By default every MqttTransport runs paho's network loop in a thread of its own
(`loop_start`). That is right for a board, where a process has one connection. A process
that plays a whole federation -- `edgefl simulate --transport mqtt`, ten clients and the
aggregator, each with its own connection -- then has eleven network threads next to the
eleven role threads, and every message wakes a network thread and then a role thread, each
taking its turn at the interpreter lock. Measured on two cores (docs/scaling.md), the ten
clients' network threads alone spent 104 ms of CPU per round of a 1M-parameter model, most
of it in the kernel waking threads; with one loop for all of them the round's overhead fell
by a quarter.

The loop drives paho through its external-loop API: select() over every registered
client's socket, then `loop_read` / `loop_write` for the ready ones and `loop_misc`
(keepalive) twice a second. Publishes from other threads are queued by paho, which tells
the loop through `on_socket_register_write` (one wake-up per burst, not per message).
Callbacks still run on a network thread and still only enqueue (MqttTransport's; a full
receive queue's short wait for room then holds up every client of the loop). What
paho's own thread did besides, the loop does too: when a connection is lost and its
transport wants it back, it reconnects with exponential backoff -- in a short-lived helper
thread, so that a broker slow to answer one client's TCP connect does not stall the others.
"""
from __future__ import annotations

import logging
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

import paho.mqtt.client as paho

__all__ = ["NetworkLoop"]

log = logging.getLogger("edgefl.transport")

_MISC_EVERY_S = 0.5          # loop_misc: keepalive pings and timeouts, as paho's loop does
_IDLE_WAIT_S = 0.5           # the longest select() when nothing is due


@dataclass
class _Entry:
    client: paho.Client
    name: str                             # for the log: the client id
    wants_reconnect: Callable[[], bool]
    reconnect_min: float
    reconnect_max: float
    delay: float | None = None            # the backoff's current delay, None when connected
    retry_at: float = 0.0                 # time.monotonic() of the next reconnect attempt
    reconnecting: bool = False            # a helper thread is in client.reconnect()
    removed: bool = False                 # remove() was called: never connect it again


class NetworkLoop:
    """One thread that runs the network side of every MqttTransport given it (module
    docstring). Thread-safe: add() and remove() from any thread; close() once all its
    transports are closed."""

    def __init__(self, name: str = "edgefl-netloop"):
        self._entries: dict[int, _Entry] = {}
        self._lock = threading.Lock()         # guards _entries
        self._busy = threading.Lock()         # held while the loop calls into paho clients
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- registration --------------------------------------------------------------------

    def add(self, client: paho.Client, name: str, wants_reconnect: Callable[[], bool],
            reconnect_min: float = 1.0, reconnect_max: float = 30.0) -> None:
        """Serve `client` (connected with client.connect(), not loop_start()). Call
        prepare() on it before connect(). wants_reconnect() says, after its connection is
        lost, whether to connect it again (False once its transport is closing)."""
        if self._closed:
            raise RuntimeError("NetworkLoop.add: the loop is closed")
        with self._lock:
            self._entries[id(client)] = _Entry(client, name, wants_reconnect, reconnect_min,
                                               reconnect_max)
        self.wake()

    def prepare(self, client: paho.Client) -> None:
        """Make paho tell this loop when `client` has something to write, instead of writing
        from the publishing thread or waking a thread of its own."""
        client.on_socket_register_write = self._on_register_write
        client.on_socket_unregister_write = _ignore

    def remove(self, client: paho.Client, flush_timeout: float = 1.0) -> None:
        """Stop serving `client`; once this returns the loop no longer calls into it. What
        paho still has to write (the DISCONNECT of a clean close) is written first, for up
        to `flush_timeout` seconds, as paho's own thread does before it stops."""
        if threading.current_thread() is not self._thread and not self._closed:
            deadline = time.monotonic() + flush_timeout
            while client.socket() is not None and client.want_write() \
                    and time.monotonic() < deadline:
                self.wake()
                time.sleep(0.005)
        with self._lock:
            entry = self._entries.pop(id(client), None)
        if entry is not None:
            entry.removed = True
        self.wake()
        if threading.current_thread() is not self._thread:
            with self._busy:                  # let a pass already inside it finish
                pass

    def wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass                              # a wake-up is already pending, or closed

    def _on_register_write(self, client, userdata, sock) -> None:
        self.wake()

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        for s in (self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass

    @property
    def clients(self) -> int:
        return len(self._entries)

    # -- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        last_misc = 0.0
        while not self._closed:
            with self._lock:
                entries = list(self._entries.values())
            now = time.monotonic()
            readers: dict = {}
            writers: dict = {}
            pending = False
            wait = _IDLE_WAIT_S
            for e in entries:
                if e.reconnecting:
                    continue
                sock = e.client.socket()
                if sock is None:
                    wait = min(wait, self._maybe_reconnect(e, now))
                    continue
                readers[sock] = e
                if e.client.want_write():
                    writers[sock] = e
                pending = pending or _pending(sock)
            try:
                ready_r, ready_w, _ = select.select([self._wake_r, *readers], list(writers),
                                                    [], 0.0 if pending else wait)
            except (OSError, ValueError):
                continue          # a socket closed under us: the next pass sees it gone
            if self._wake_r in ready_r:
                try:
                    self._wake_r.recv(65536)
                except OSError:
                    pass
            with self._busy:
                with self._lock:
                    live = set(self._entries)
                for sock, e in readers.items():
                    if id(e.client) in live and (sock in ready_r or _pending(sock)):
                        self._call(e, e.client.loop_read)
                for sock, e in writers.items():
                    if id(e.client) in live and sock in ready_w and e.client.socket() is sock:
                        self._call(e, e.client.loop_write)
                now = time.monotonic()
                if now - last_misc >= _MISC_EVERY_S:
                    last_misc = now
                    for e in entries:
                        if id(e.client) in live and not e.reconnecting:
                            self._call(e, e.client.loop_misc)
                            if e.client.is_connected():
                                e.delay = None           # connected again: backoff reset

    def _call(self, e: _Entry, method) -> None:
        try:
            method()
        except Exception:     # noqa: BLE001 -- one client's failure must not stop the others
            log.exception("network loop: %s of %r failed", method.__name__, e.name)

    def _maybe_reconnect(self, e: _Entry, now: float) -> float:
        """For a client without a socket: start a reconnect when it is due; how long until
        the loop should look again."""
        if not e.wants_reconnect():
            return _IDLE_WAIT_S
        if e.delay is None:                                   # just lost: first delay
            e.delay = e.reconnect_min
            e.retry_at = now + e.delay
        if now < e.retry_at:
            return e.retry_at - now
        e.reconnecting = True
        threading.Thread(target=self._reconnect, args=(e,), daemon=True,
                         name="edgefl-netloop-reconnect").start()
        return _IDLE_WAIT_S

    def _reconnect(self, e: _Entry) -> None:
        try:
            if e.wants_reconnect() and not e.removed:
                e.client.reconnect()
                if e.removed:
                    # its transport closed while this connect was under way: nothing will
                    # serve the new connection, so drop it (the broker sees it go)
                    sock = e.client.socket()
                    if sock is not None:
                        sock.close()
        except OSError as exc:
            log.debug("network loop: reconnect of %r failed: %s", e.name, exc)
        except Exception:     # noqa: BLE001 -- logged; retried like a refused connect
            log.exception("network loop: reconnect of %r failed", e.name)
        finally:
            e.delay = min((e.delay or e.reconnect_min) * 2, e.reconnect_max)
            e.retry_at = time.monotonic() + e.delay
            e.reconnecting = False
            self.wake()


def _pending(sock) -> bool:
    """TLS: bytes already decrypted and not yet read, which select() does not see."""
    has_pending = getattr(sock, "pending", None)
    return has_pending is not None and has_pending() > 0


def _ignore(*args) -> None:
    pass
