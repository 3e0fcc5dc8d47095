"""Stop on SIGTERM/SIGINT: the first signal asks the main loop to stop, a second one kills.

systemd stops a service with SIGTERM and waits `TimeoutStopSec=` before SIGKILL; edgefl's
rule (docs/deployment.md, "Stopping and restarting") is that a role then finishes or abandons
its current step, persists its state and exits 0. The handler only sets an event; the loop
polls it between steps (or waits on it):

    stop = install_stop_handlers()
    while not stop.is_set():
        do_one_step()                      # short, or run in a worker thread (see below)
        stop.wait(poll_seconds)            # sleeps, but returns as soon as a signal arrives
    persist_state(); return 0

Python runs signal handlers in the main thread between bytecodes, so a main thread inside one
long C call (a local round) would see the signal only when that call returns. The StopSignal
is therefore also a kernels.StopFlag: a watcher thread, woken through the interpreter's
wakeup file descriptor (signal.set_wakeup_fd, written by the C-level handler the moment the
signal arrives), sets its stop word at once, and every local round that was handed the flag
(LocalData.stop) stops before its next step, on whatever thread it runs -- the main one
included. The watcher also sets the event that wakes `wait`. The Python handler must not:
it runs in the main thread between any two bytecodes, possibly while that thread holds the
event's lock inside `wait()`, and taking the lock again there deadlocks the process (seen in
CI: `edgefl broker`, whose handler then set a plain Event, stuck after Ctrl-C). So the
handler takes no lock; it counts the signal and records which one it was.

A second stop signal while stopping restores the default action and re-raises it, so an
operator's second Ctrl-C (or `systemctl kill`) ends a process whose clean-up hangs.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading

from ..kernels import StopFlag

__all__ = ["StopSignal", "install_stop_handlers", "exit_status"]

log = logging.getLogger("edgefl.service.signals")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal(StopFlag):
    """The stop request set by the handlers of `install_stop_handlers`: a kernels.StopFlag
    (set, is_set, wait; its stop word stops local training within one step).

    `signum` is the first signal received (None before), `name` its name ("SIGTERM")."""

    def __init__(self, signals=STOP_SIGNALS):
        super().__init__()
        self.signals = tuple(signals)
        self.signum: int | None = None
        self._received = 0                      # signals seen by the handler
        self._previous: dict[int, object] = {}
        self._wakeup: tuple | None = None      # (reader, writer, previous fd, watcher thread)

    @property
    def event(self) -> "StopSignal":
        """The event to wait on: the StopSignal itself (kept for callers of the old API)."""
        return self

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum is not None else None

    def request(self, signum: int | None = None) -> None:
        """Ask for a stop from code (an operator's `stop` command over MQTT, a test)."""
        if self.signum is None:
            self.signum = signum
        self.set()

    # ---------------------------------------------------------------- the handlers
    def _watch(self, reader: socket.socket) -> None:
        """The watcher thread: one byte per signal arrives here from the C-level handler, even
        while the main thread is inside a C call; one of ours sets the stop word at once."""
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:                    # restore() closed the writer
                return
            ours = [b for b in data if b in self.signals]
            if ours and not self.is_set():
                if self.signum is None:
                    self.signum = ours[0]
                self.set()
                log.info("%s: stopping after the current step", signal.Signals(ours[0]).name)

    def _handle(self, signum, frame) -> None:
        # no lock here, not even the event's (the module docstring): the watcher sets it
        self._received += 1
        if self._received > 1:
            # second signal: the clean stop is taking too long; die by this signal
            log.warning("%s again while stopping: exiting now", signal.Signals(signum).name)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.signum is None:
            self.signum = signum
        self.word[0] = 1
        # the C-level handler has already woken the watcher through the wakeup fd, unless
        # code installed another wakeup fd since (asyncio's add_signal_handler does): wake it
        # on its own socket too (a second byte is ignored), without blocking
        if self._wakeup is not None:
            try:
                self._wakeup[1].send(bytes([signum]))
            except OSError:
                pass

    def install(self) -> "StopSignal":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("install_stop_handlers: signal handlers can only be installed "
                               "from the main thread")
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        reader, writer = socket.socketpair()
        writer.setblocking(False)           # the C-level handler must never block on it
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        watcher = threading.Thread(target=self._watch, args=(reader,), daemon=True,
                                   name="edgefl-stop-signal")
        watcher.start()
        self._wakeup = (reader, writer, previous, watcher)
        return self

    def restore(self) -> None:
        """Put back the handlers (and the wakeup fd) that were there before install()."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._wakeup is not None:
            reader, writer, previous, watcher = self._wakeup
            self._wakeup = None
            signal.set_wakeup_fd(previous)
            writer.close()                  # the watcher reads end-of-file and returns
            watcher.join()
            reader.close()

    def __enter__(self) -> "StopSignal":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def install_stop_handlers(signals=STOP_SIGNALS) -> StopSignal:
    """Route `signals` (SIGTERM and SIGINT) to a new StopSignal and return it. Call from the
    main thread, once, before the main loop; `restore()` (or a with-block) undoes it."""
    return StopSignal(signals).install()


def exit_status(stop: StopSignal) -> int:
    """The status a command that runs to an end of its own (`edgefl simulate`) exits with
    when a signal stopped it: 128 + the signal's number, as a shell reports a command the
    signal killed (130 for SIGINT, 143 for SIGTERM), so scripts see it was cut short; 1 for
    a stop requested from code. The services exit 0 instead (docs/reliability.md)."""
    return 128 + stop.signum if stop.signum is not None else 1
