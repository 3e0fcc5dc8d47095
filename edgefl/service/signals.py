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
long C call (a local epoch) sees the signal only when that call returns. A role that must
react within seconds runs long C calls in a worker thread (the C core releases the GIL) and
waits on `stop` in the main thread; a signal then interrupts the wait at once.

A second stop signal while stopping restores the default action and re-raises it, so an
operator's second Ctrl-C (or `systemctl kill`) ends a process whose clean-up hangs.
"""
from __future__ import annotations

import logging
import os
import signal
import threading

__all__ = ["StopSignal", "install_stop_handlers"]

log = logging.getLogger("edgefl.service.signals")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """The stop request set by the handlers of `install_stop_handlers`.

    `signum` is the first signal received (None before), `name` its name ("SIGTERM")."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = tuple(signals)
        self.event = threading.Event()
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    # ---------------------------------------------------------------- the loop's side
    def is_set(self) -> bool:
        return self.event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep up to `timeout` seconds, returning early (True) when a stop was requested."""
        return self.event.wait(timeout)

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum is not None else None

    def request(self, signum: int | None = None) -> None:
        """Ask for a stop from code (an operator's `stop` command over MQTT, a test)."""
        if self.signum is None:
            self.signum = signum
        self.event.set()

    # ---------------------------------------------------------------- the handler
    def _handle(self, signum, frame) -> None:
        if self.event.is_set() and self.signum is not None:
            # second signal: the clean stop is taking too long; die by this signal
            log.warning("%s again while stopping: exiting now", signal.Signals(signum).name)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        self.event.set()
        log.info("%s: stopping after the current step", signal.Signals(signum).name)

    def install(self) -> "StopSignal":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("install_stop_handlers: signal handlers can only be installed "
                               "from the main thread")
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        """Put back the handlers that were there before install()."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> "StopSignal":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def install_stop_handlers(signals=STOP_SIGNALS) -> StopSignal:
    """Route `signals` (SIGTERM and SIGINT) to a new StopSignal and return it. Call from the
    main thread, once, before the main loop; `restore()` (or a with-block) undoes it."""
    return StopSignal(signals).install()
