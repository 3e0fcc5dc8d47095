"""Many client roles driven by one thread, and clients spread over worker processes: how
`run_over_broker` hosts a simulated fleet (issue 19, docs/scaling.md).

    host = ClientHost(clients, stop, errors)     # roles.Client objects, not yet started
    ... each client's start() (connect, subscribe) in a connecting thread, then host.wake(i)
    host.run()                                   # until every client is done, or stop

A `roles.Client` on a board runs its own loop (`Client.run`). A simulation used to give each
of its clients a thread running that loop: at 10,000 clients, 10,000 threads, each woken by
every announcement and by its own poll, used up both cores of this machine before the fleet
had even connected. A ClientHost runs the same client code -- `Client.step()` is one pass
of `Client.run`'s loop -- from one thread, and only for the clients that have work: each
client's receive queue tells the host when an item comes in (`ReceiveQueue.on_item`), and
an idle client costs nothing between messages. Every client keeps its own MQTT connection
and session and speaks the real protocol; a tasked client still trains in a thread of its
own (the C core releases the interpreter lock). The clients of one host share one
AnnouncementCache, so an announcement that reaches all of them is parsed once.

`serve_clients` is the body of one worker process of a fleet spread over several
(`run_over_broker(..., client_processes=K)`): its own network loop, connecting threads and
ClientHost for its share of the clients, reporting over a pipe to the process that runs the
aggregator. The processes are forked, so the clients' data is shared, not copied.
"""
from __future__ import annotations

import copyreg
import io
import logging
import pickle
import queue
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

__all__ = ["ClientHost", "ReadyWaiter", "CONNECTING", "start_clients", "serve_clients",
           "tick_for"]

log = logging.getLogger("edgefl.sim")

CONNECTING = 64        # clients connecting and subscribing at once
_CLOSING = 32          # clients closing their connections at once


def tick_for(clients: int) -> float:
    """How often a host steps all its clients (a model asked for again, stop noticed): the
    sweep over 10,000 clients costs tens of milliseconds of the interpreter lock."""
    return max(0.25, min(2.0, clients / 2000))


class ClientHost:
    """Drives `clients` (roles.Client): a client's step() runs when its receive queue gets
    an item, and every `tick_s` for all of them (a model that does not come is asked for
    again; `stop` is noticed). A client is stepped only once its start() has returned and
    wake(i) was called. An exception of a client's (a local round that failed, with
    raise_on_error) goes to `errors` and sets `stop`. When every client is done, or stop is
    set, the started clients are finished (their connections closed) and run() returns.

    Who steps them: the thread that calls run(), or, given `network` (the NetworkLoop that
    serves every client's connection), that loop's thread, after each of its passes. Then
    a message is handled where it is read, and its reply written there too: no hand-over
    to another thread and back for every message (at 100 clients, 10 a round, those
    hand-overs of the interpreter lock were much of a worker's CPU). run() then only waits,
    and finishes the clients from its own thread, since closing a connection needs the
    loop."""

    def __init__(self, clients: list, stop, errors: list, tick_s: float = 0.5,
                 network=None):
        self.clients = clients
        self.stop, self.errors = stop, errors
        self.tick_s = tick_s
        self._work: queue.SimpleQueue = queue.SimpleQueue()     # client indexes with work
        self._started = [False] * len(clients)
        self._done = [False] * len(clients)
        self.remaining = len(clients)
        self._network = network
        self._last_tick = time.monotonic()
        self._over = threading.Event()         # every client done, or stop (with network)
        for i, client in enumerate(clients):
            client.transport.messages.on_item = (lambda i=i: self._put(i))
        if network is not None:
            network.set_on_pass(self._service)

    def _put(self, i: int) -> None:
        self._work.put(i)
        if self._network is not None:
            self._network.wake()              # (a no-op on the loop's own thread)

    def wake(self, i: int) -> None:
        """Client i has started (its start() returned): step it from now on."""
        self._put(-1 - i)

    def run(self) -> None:
        try:
            if self._network is not None:
                while not self._over.wait(self.tick_s):
                    if self.stop.is_set():
                        break
                self._network.set_on_pass(None)     # returns once no step is under way
                return
            while self.remaining and not self.stop.is_set():
                try:
                    batch = {self._work.get(timeout=self.tick_s)}
                except queue.Empty:
                    batch = set()
                self._serve(batch)
                if self.stop.is_set():
                    break
        finally:
            self.finish()

    def _service(self) -> float:
        """The network loop's thread, after a pass: step the clients with work (and all of
        them when a tick is due). Returns how soon it wants to be called again."""
        self._serve(set())
        if not self.remaining or self.stop.is_set():
            self._over.set()
        return max(0.0, self._last_tick + self.tick_s - time.monotonic())

    def _serve(self, batch: set) -> None:
        while True:
            try:
                batch.add(self._work.get_nowait())
            except queue.Empty:
                break
        for i in sorted(batch):
            if i < 0:
                self._started[-1 - i] = True
                self._step(-1 - i)
            elif self._started[i]:
                self._step(i)
        now = time.monotonic()
        if now - self._last_tick >= self.tick_s:
            self._last_tick = now
            for i, started in enumerate(self._started):
                if started and not self._done[i]:
                    self._step(i)

    def _step(self, i: int) -> None:
        if self._done[i]:
            return
        client = self.clients[i]
        try:
            done = client.step(0.0) or client.done
        except BaseException as exc:       # noqa: BLE001 -- re-raised by the caller
            self.errors.append(exc)
            self.stop.set()
            done = True
        if done:
            self._done[i] = True
            self.remaining -= 1

    def finish(self) -> None:
        """Finish every started client (stop a round still training, close the connection),
        a few at a time: each close waits for the broker to take its DISCONNECT."""
        started = [c for i, c in enumerate(self.clients) if self._started[i]]
        self._started = [False] * len(self.clients)

        def finish_one(client):
            try:
                client.finish()
            except Exception as exc:         # noqa: BLE001 -- one close must not stop the rest
                log.warning("%s: closing: %s", client.node, exc)

        with ThreadPoolExecutor(max_workers=_CLOSING, thread_name_prefix="edgefl-close") as pool:
            list(pool.map(finish_one, started))


class ConnectStopped(RuntimeError):
    """The stop flag was set while the clients were connecting: in the simulating process,
    a stop request before round 1 (run_over_broker raises RunStopped for it); in a worker,
    its own stop."""

    def __init__(self):
        super().__init__("stopped while the simulation's clients were connecting")


class ReadyWaiter:
    """Waits until fewer than n of the client roles started so far are not yet ready
    (connected and subscribed). Fails when one raised, or when none became ready for
    `stall_s` seconds: a fleet of any size connects as long as it keeps making progress."""

    def __init__(self, roles: list, errors: list, stop, stall_s: float, address):
        self.roles, self.errors, self.stop = roles, errors, stop
        self.stall_s, self.address = stall_s, address
        self.ready = 0                 # roles[:ready] are all ready
        self.progress_at = time.monotonic()
        self.last_waiting = 0

    def wait_below(self, n: int) -> None:
        while True:
            while self.ready < len(self.roles) and self.roles[self.ready].ready.is_set():
                self.ready += 1
                self.progress_at = time.monotonic()
            waiting = [r for r in self.roles[self.ready:] if not r.ready.is_set()]
            if len(waiting) < self.last_waiting:
                self.progress_at = time.monotonic()
            self.last_waiting = len(waiting)
            if len(waiting) < n:
                return
            if self.errors:
                self.stop.set()
                raise self.errors[0]
            if self.stop.is_set():
                raise ConnectStopped()
            if time.monotonic() - self.progress_at > self.stall_s:
                self.stop.set()
                raise TimeoutError(f"simulation clients did not connect to {self.address}: "
                                   f"none became ready for {self.stall_s:g} s "
                                   f"({self.ready} of {len(self.roles)} started were)")
            waiting[0].ready.wait(0.05)


def start_clients(clients: list, host: ClientHost, errors: list, stop, stall_s: float,
                  address, on_progress=None) -> None:
    """Start (connect and subscribe) every client, at most CONNECTING at a time, each in a
    short-lived thread that hands it to `host` once started. Returns when all are ready;
    raises the first error, or TimeoutError when none became ready for `stall_s` seconds.
    Thousands of clients connecting at once starve each other and the network loop of the
    interpreter lock and overflow the broker's listen backlog (10,000 at once: keepalives
    missed). on_progress(ready) is called now and then."""
    started: list = []
    waiter = ReadyWaiter(started, errors, stop, stall_s, address)
    for i, client in enumerate(clients):
        def body(i=i, client=client):
            try:
                client.start()
            except BaseException as exc:       # noqa: BLE001 -- re-raised by the waiter
                errors.append(exc)
                stop.set()
                return
            host.wake(i)

        waiter.wait_below(CONNECTING)
        threading.Thread(target=body, name=f"edgefl-connect-{client.node}", daemon=True).start()
        started.append(client)
        if on_progress is not None and i % CONNECTING == 0:
            on_progress(waiter.ready)
    waiter.wait_below(1)
    if on_progress is not None:
        on_progress(len(clients))


def worker_stop_signal():
    """The stop flag of a forked worker process, and its signals: a Ctrl-C reaches the whole
    process group, so the parent stops the run and then tells us (SIGINT is ignored here);
    SIGTERM to this process alone stops its clients. Both of the parent's handlers came
    through the fork: its Python handler would set the parent's flag in this copy of it,
    and its wakeup fd (one end of the parent's socket pair) would wake the parent's watcher
    and stop the parent's run; these replace both."""
    import signal

    from ..service.signals import install_stop_handlers

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return install_stop_handlers((signal.SIGTERM,))


def serve_clients(make_clients, conn, stall_s: float, address) -> None:
    """The body of a worker process: make_clients(stop) -> (clients, network loop); start
    them, report ("ready", n) over `conn` as they connect, drive them with a ClientHost
    until the run is finished or the parent sends "stop", then send ("done", client states,
    error or None), and exit with status 1 if there was an error. Runs in a forked child."""
    stop = worker_stop_signal()
    errors: list = []
    send_lock = threading.Lock()

    def send(msg) -> None:
        with send_lock:
            try:
                conn.send(msg)
            except (OSError, ValueError):
                stop.set()                       # the parent is gone

    def listen() -> None:
        try:
            while not stop.is_set():
                if conn.poll(0.2) and conn.recv() == "stop":
                    break
        except (EOFError, OSError):
            pass                                 # the parent is gone: stop too
        stop.set()

    threading.Thread(target=listen, name="edgefl-worker-listen", daemon=True).start()
    clients, network = [], None
    try:
        clients, network = make_clients(stop)
        host = ClientHost(clients, stop, errors, tick_s=tick_for(len(clients)),
                          network=network)
        hosting = threading.Thread(target=host.run, name="edgefl-client-host", daemon=True)
        hosting.start()
        try:
            start_clients(clients, host, errors, stop, stall_s, address,
                          on_progress=lambda n: send(("ready", n)))
        finally:
            hosting.join()
    except BaseException as exc:                 # noqa: BLE001 -- reported to the parent
        errors.append(exc)
    finally:
        if network is not None:
            network.close()
    error = errors[0] if errors else None
    if error is not None:
        try:
            _dumps(error)
        except Exception:                        # noqa: BLE001 -- sent as text instead
            error = RuntimeError(f"{type(error).__name__}: {error}")
    try:
        last = _dumps(("done", {c.node: c.client_state for c in clients}, error))
    except Exception as exc:                     # noqa: BLE001 -- reported instead
        last = _dumps(("done", {}, error or RuntimeError(
            f"the clients' states cannot be sent to the simulating process: {exc}")))
    with send_lock:
        try:
            conn.send_bytes(last)                # the parent's recv() unpickles it
        except (OSError, ValueError):
            pass                                 # the parent is gone
    if error is not None:
        # a worker that failed says so in its exit status too (1, as a command that failed),
        # for whoever looks at the process rather than the pipe
        raise SystemExit(1)


def _mappingproxy(d: dict):
    return types.MappingProxyType(d)


def _dumps(obj) -> bytes:
    """pickle, also of the read-only mappings strategies keep their client state in."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table,
                              types.MappingProxyType: lambda m: (_mappingproxy, (dict(m),))}
    pickler.dump(obj)
    return buf.getvalue()
