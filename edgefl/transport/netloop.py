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

The loop drives paho through its external-loop API: an epoll (`selectors`) registration of
every client's socket, `loop_read` / `loop_write` for the ready ones and `loop_misc`
(keepalive) twice a second. Publishes from other threads are queued by paho, which tells
the loop through `on_socket_register_write` (one wake-up per burst, not per message); the
loop then adds write interest for that socket until paho has written everything. A pass
costs in proportion to the sockets that are ready, not to the clients served: at 10,000
connections (issue 19) a scan of every client per pass, and select() itself (no file
descriptor above 1023), were what stopped the loop.
Callbacks still run on a network thread and still only enqueue (MqttTransport's; a full
receive queue's short wait for room then holds up every client of the loop). What
paho's own thread did besides, the loop does too: when a connection is lost and its
transport wants it back, it reconnects with exponential backoff -- in a short-lived helper
thread, so that a broker slow to answer one client's TCP connect does not stall the others.
"""
from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

import paho.mqtt.client as paho

__all__ = ["NetworkLoop"]

log = logging.getLogger("edgefl.transport")

_MISC_EVERY_S = 0.5          # loop_misc: keepalive pings and timeouts, as paho's loop does
_IDLE_WAIT_S = 0.5           # the longest wait when nothing is due
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


@dataclass(eq=False)                      # identity hash: entries are kept in sets
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
    sock: object = None                   # the socket registered with the selector (loop thread)
    events: int = 0                       # its registered events


class NetworkLoop:
    """One thread that runs the network side of every MqttTransport given it (module
    docstring). Thread-safe: add() and remove() from any thread; close() once all its
    transports are closed."""

    def __init__(self, name: str = "edgefl-netloop"):
        self._entries: dict[int, _Entry] = {}
        self._lock = threading.Lock()         # guards _entries and _dirty
        self._busy = threading.Lock()         # held while the loop calls into paho clients
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, _READ, None)
        # entries whose socket or write interest may have changed, told by any thread; the
        # loop thread brings the selector in line (_sync) before it waits
        self._dirty: set[_Entry] = set()
        self._offline: set[_Entry] = set()    # no socket: reconnected when due (loop thread)
        # set_on_pass: called by this thread after each pass; held while it runs
        self._on_pass: Callable[[], float] | None = None
        self._pass_lock = threading.Lock()
        self._pass_wait = _IDLE_WAIT_S
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
        entry = _Entry(client, name, wants_reconnect, reconnect_min, reconnect_max)
        with self._lock:
            self._entries[id(client)] = entry
            self._dirty.add(entry)
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
                self._mark(client)
                time.sleep(0.005)
        with self._lock:
            entry = self._entries.pop(id(client), None)
            if entry is not None:
                entry.removed = True
                self._dirty.add(entry)        # the loop unregisters its socket
        self.wake()
        if threading.current_thread() is not self._thread:
            with self._busy:                  # let a pass already inside it finish
                pass

    def wake(self) -> None:
        """Make the loop look at its registrations (and call on_pass) now; a no-op on the
        loop's own thread, which does so before it waits again."""
        if threading.current_thread() is self._thread:
            return
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass                              # a wake-up is already pending, or closed

    def set_on_pass(self, fn: Callable[[], float] | None) -> None:
        """Have the loop's thread call fn() after each of its passes, outside any paho
        call (sim.hosting steps its clients there, so a message is handled on the thread
        that read it); fn returns how soon it wants to be called again (seconds). None
        removes it: once this returns (from another thread), fn is not running and is not
        called again."""
        if threading.current_thread() is self._thread:
            self._on_pass = fn
            return
        with self._pass_lock:
            self._on_pass = fn
        self.wake()

    def _mark(self, client) -> None:
        """`client` has something to write (or its socket changed): the loop looks at it."""
        with self._lock:
            entry = self._entries.get(id(client))
            if entry is not None:
                self._dirty.add(entry)
        if threading.current_thread() is not self._thread:
            self.wake()

    def _on_register_write(self, client, userdata, sock) -> None:
        # paho has a packet to write (a publish, from the publishing thread). When the loop
        # is not inside a paho call just now, write it from here: waking the loop thread to
        # write it cost a wake-up byte, an epoll pass and two hand-overs of the interpreter
        # lock per message (at 100 clients, 10 a round, a fifth of a worker's CPU). The
        # loop's `_busy` lock makes this thread the only one in a paho client meanwhile, as
        # paho's single-threaded use wants (on the loop's thread it is held inside a paho
        # call: a PUBACK queued while reading is the loop's). What is left unwritten (a
        # full socket buffer), a connection lost on the way and a closing client (whose
        # DISCONNECT paho follows with a drain of the socket) are the loop's.
        if self._busy.acquire(blocking=False):
            e = self._entries.get(id(client))
            try:
                if e is not None and not e.removed and not e.reconnecting \
                        and e.sock is sock and e.wants_reconnect():
                    client.loop_write()
                    if not client.want_write() and client.socket() is sock:
                        return
            except Exception:     # noqa: BLE001 -- the loop retries it
                log.exception("network loop: writing for %r failed", getattr(e, "name", "?"))
            finally:
                self._busy.release()
        self._mark(client)

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
        try:
            self._selector.close()
        except OSError:
            pass

    @property
    def clients(self) -> int:
        return len(self._entries)

    # -- the loop ------------------------------------------------------------------------

    def _sync(self, e: _Entry) -> None:
        """Loop thread: register e's current socket for reading, and for writing while paho
        has something to write; unregister a socket that closed or an entry removed."""
        sock = None
        if not e.removed and not e.reconnecting:
            sock = e.client.socket()
        events = 0
        if sock is not None:
            events = _READ | (_WRITE if e.client.want_write() else 0)
        if sock is not e.sock and e.sock is not None:
            self._unregister(e)
        if sock is None:
            if not e.removed:
                self._offline.add(e)
            else:
                self._offline.discard(e)
            return
        self._offline.discard(e)
        if e.sock is None:
            try:
                self._selector.register(sock, events, e)
            except KeyError:
                # the file descriptor of a socket another entry had, closed since and reused
                # by this one before that entry was brought in line
                stale = self._selector.get_map().get(sock.fileno())
                if stale is None or stale.data is None:
                    return
                self._unregister(stale.data)
                self._selector.register(sock, events, e)
            except (ValueError, OSError):
                return                        # closed under us: the next look sees it gone
            e.sock, e.events = sock, events
        elif events != e.events:
            try:
                self._selector.modify(sock, events, e)
                e.events = events
            except (KeyError, ValueError, OSError):
                self._unregister(e)

    def _unregister(self, e: _Entry) -> None:
        try:
            self._selector.unregister(e.sock)
        except (KeyError, ValueError, OSError):
            pass
        e.sock, e.events = None, 0

    def _run(self) -> None:
        last_misc = 0.0
        pending: set = set()                  # TLS sockets with decrypted bytes unread
        while not self._closed:
            with self._lock:
                dirty, self._dirty = self._dirty, set()
            for e in dirty:
                self._sync(e)
            now = time.monotonic()
            wait = max(0.0, min(_IDLE_WAIT_S, last_misc + _MISC_EVERY_S - now,
                                self._pass_wait))
            for e in list(self._offline):
                wait = min(wait, self._maybe_reconnect(e, now))
            try:
                ready = self._selector.select(0.0 if pending else wait)
            except (OSError, ValueError):
                continue          # a socket closed under us: the next pass sees it gone
            with self._busy:
                served = []
                for key, mask in ready:
                    e = key.data
                    if e is None:
                        try:
                            self._wake_r.recv(65536)
                        except OSError:
                            pass
                        continue
                    if e.removed or e.sock is not key.fileobj:
                        continue
                    if mask & _READ:
                        self._call(e, e.client.loop_read)
                    if mask & _WRITE and e.client.socket() is key.fileobj:
                        self._call(e, e.client.loop_write)
                    served.append(e)
                for e in pending:
                    if not e.removed and e not in served and e.client.socket() is not None:
                        self._call(e, e.client.loop_read)
                        served.append(e)
                pending = set()
                for e in served:
                    if _pending(e.client.socket()):
                        pending.add(e)
                    self._sync(e)             # the socket closed, or paho wrote everything
                now = time.monotonic()
                # every client, twice a second up to 1,000 of them; beyond, less often (a
                # pass over 10,000 clients is ~0.1 s of the interpreter lock): keepalives
                # are tens of seconds
                if now - last_misc >= max(_MISC_EVERY_S, len(self._entries) / 2000):
                    last_misc = now
                    with self._lock:
                        entries = list(self._entries.values())
                    for e in entries:
                        if not e.removed and not e.reconnecting:
                            self._call(e, e.client.loop_misc)
                            if e.client.is_connected():
                                e.delay = None           # connected again: backoff reset
                            self._sync(e)
            if self._on_pass is not None:
                with self._pass_lock:
                    fn = self._on_pass
                    if fn is not None:
                        try:
                            self._pass_wait = fn()
                        except Exception:     # noqa: BLE001 -- the loop must go on
                            log.exception("network loop: on_pass failed")
                            self._pass_wait = _IDLE_WAIT_S
            else:
                self._pass_wait = _IDLE_WAIT_S

    def _call(self, e: _Entry, method) -> None:
        try:
            method()
        except Exception:     # noqa: BLE001 -- one client's failure must not stop the others
            log.exception("network loop: %s of %r failed", method.__name__, e.name)

    def _maybe_reconnect(self, e: _Entry, now: float) -> float:
        """For a client without a socket: start a reconnect when it is due; how long until
        the loop should look again."""
        if e.removed or e.reconnecting:
            return _IDLE_WAIT_S
        if not e.wants_reconnect():
            self._offline.discard(e)
            return _IDLE_WAIT_S
        if e.delay is None:                                   # just lost: first delay
            e.delay = e.reconnect_min
            e.retry_at = now + e.delay
        if now < e.retry_at:
            return e.retry_at - now
        e.reconnecting = True
        self._offline.discard(e)
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
            with self._lock:
                self._dirty.add(e)
            self.wake()


def _pending(sock) -> bool:
    """TLS: bytes already decrypted and not yet read, which select() does not see."""
    if sock is None:
        return False
    has_pending = getattr(sock, "pending", None)
    return has_pending is not None and has_pending() > 0


def _ignore(*args) -> None:
    pass
