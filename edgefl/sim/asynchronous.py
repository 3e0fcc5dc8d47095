"""Buffered asynchronous rounds in process (FedBuff): the round engine's asynchronous caller,
driven by the virtual clock (edgefl/sim/clock.py).

    C clients train at once. At time 0 the engine tasks C of the idle clients from version 0.
    Each task's update arrives after its simulated duration (Clock.task_seconds). At each
    simulated instant, in event order:
      - every update arriving then is checked (the strategy's staleness_refusal: too stale
        is dropped and counted) and goes into the buffer;
      - when the buffer holds K updates the engine closes step r (`close_buffer`: each update
        checked against the plan that tasked it, the strategy's aggregate, the record,
        evaluation when due) and the version becomes r;
      - then the idle clients refill the C slots (`open_round(r + 1, state, among=idle,
        count=n, draw=j)`), from the current version.
    The run ends after `rounds` steps; updates still in flight are discarded.

Selection, tasks, the upload check, aggregation, the record and the evaluation schedule stay
the engine's; the order of events is the clock's alone. A task is trained on the thread pool
as soon as it is dispatched and its result waited for when its arrival comes up, so the
threads only change when the arithmetic happens, never what it is: the model is the same for
any number of workers (tests/test_fedbuff.py). With every task equally long (no `sim_fleet:`) and
K = C every buffer is one cohort of fresh updates, a synchronous round.

Each record has the engine's keys plus sim_time_s (the simulated time of the step),
dropped_stale (updates refused as too stale since the last step) and dropped_bytes (their
float32 bytes: moved, not used).
"""
from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Mapping

import numpy as np

from ..errors import NonFiniteError, RunStopped, TrainingStopped
from ..rounds import RoundEngine
from ..runs.prepare import RunResult
from ..strategies import LocalData, Setup, Strategy
from .clock import Clock, EventQueue

__all__ = ["run_asynchronous"]


def run_asynchronous(strategy: Strategy, init_params: np.ndarray,
                     clients: Mapping[int, LocalData], setup: Setup, clients_per_round: int, *,
                     clock: Clock | None = None, rounds: int | None = None,
                     test: tuple | None = None, eval_every: int = 1,
                     workers: int | None = None,
                     on_round: Callable[[dict], None] | None = None,
                     on_model: Callable[[int, np.ndarray], None] | None = None,
                     stop=None) -> RunResult:
    """Run `rounds` (default setup.rounds) server steps of an asynchronous `strategy` (its
    `resolved(clients_per_round)` gives C and K) over in-memory `clients` on `clock`
    (default: lockstep). on_round and on_model as run_federation's.

    stop: as run_federation's (a kernels.StopFlag, also in the clients' LocalData): once it
    is set no further update is taken and RunStopped is raised, holding the steps taken
    (their history and the model of the last one); the step being filled is dropped."""
    rounds = setup.rounds if rounds is None else rounds
    clock = Clock.lockstep() if clock is None else clock
    missing = sorted(set(setup.clients) - set(clients))
    if missing:
        raise ValueError(f"run_asynchronous: no local data for client(s) {missing[:10]}")
    model = clients[setup.clients[0]].model
    if not setup.units:
        setup = dataclasses.replace(setup, units=Setup.units_of(model))
    workers = (os.cpu_count() or 1) if workers is None else int(workers)
    if workers < 1:
        raise ValueError(f"workers = {workers}: need at least 1 thread")
    concurrency, buffer_size = strategy.resolved(clients_per_round)
    concurrency = min(concurrency, len(setup.clients))
    engine = RoundEngine.for_run(strategy, setup, model, clients_per_round, rounds=rounds,
                                 eval_every=eval_every, test=test)
    state = strategy.init(init_params, setup)
    client_states: dict = {c: None for c in setup.clients}
    history: list = []
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="edgefl-client") \
        if workers > 1 else None
    events = EventQueue()
    idle = set(setup.clients)
    run_started = time.perf_counter()
    step = _Step(started=run_started)

    def train(plan, c):
        try:
            return strategy.train(plan.tasks[c], clients[c], client_states[c])
        except NonFiniteError as exc:
            raise NonFiniteError(exc.step, f"version {plan.round - 1}, client {c}: "
                                           f"{exc}") from exc

    def refill(now: float) -> None:
        n = min(concurrency - (len(setup.clients) - len(idle)), len(idle))
        if n <= 0:
            return
        plan = engine.open_round(step.version + 1, state, among=sorted(idle), count=n,
                                 draw=step.draws)
        step.draws += 1
        step.tasked.append(plan)
        for c in plan.selected:
            idle.discard(c)
            if pool is not None:
                result = pool.submit(train, plan, c)
            else:
                result = _done(train(plan, c))
            events.push(now + clock.task_seconds(c, plan.tasks[c], clients[c].num_samples),
                        (plan, c, result))

    def stopped() -> RunStopped:
        return RunStopped(step.version + 1, RunResult(state, client_states, history,
                                                      strategy.global_model(state)), rounds)

    try:
        refill(0.0)
        while step.version < rounds:
            now, arrivals = events.pop_simultaneous()
            for plan, c, result in arrivals:
                if stop is not None and stop.is_set():     # before each arrival: one
                    raise stopped()                         # instant may close many steps
                update, new_state = result.result()
                client_states[c] = new_state
                idle.add(c)
                if step.version >= rounds:
                    continue
                if strategy.staleness_refusal(update, state) is not None:
                    step.dropped += 1
                    step.dropped_bytes += update.nbytes
                    continue
                step.buffer.append((plan, c, update))
                if len(step.buffer) == buffer_size:
                    state = _close(engine, step, state, now, run_started, history, on_round,
                                   on_model)
            if step.version < rounds:
                refill(now)
    except TrainingStopped:              # a local round stopped by the clients' stop flag
        raise stopped() from None
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return RunResult(state, client_states, history, strategy.global_model(state))


@dataclasses.dataclass
class _Step:
    """The asynchronous driver's bookkeeping of the step being filled."""
    started: float
    version: int = 0
    draws: int = 0               # refills opened at this version (select_clients' draw)
    tasked: list = dataclasses.field(default_factory=list)    # their plans
    buffer: list = dataclasses.field(default_factory=list)    # (plan, client, update)
    dropped: int = 0
    dropped_bytes: int = 0


def _close(engine, step: _Step, state, now, run_started, history, on_round, on_model):
    r = step.version + 1
    extras = {"sim_time_s": now, "dropped_stale": step.dropped,
              "dropped_bytes": step.dropped_bytes}
    wall = time.perf_counter() - step.started
    closed = engine.close_buffer(r, step.buffer, step.tasked, state, started=step.started,
                                 train_wall_s=wall,
                                 elapsed_before=step.started - run_started,
                                 extras=lambda: extras)
    history.append(closed.record)
    if on_round is not None:
        on_round(closed.record)
    if on_model is not None:
        on_model(r, closed.model)
    step.version, step.draws, step.tasked, step.buffer = r, 0, [], []
    step.dropped = step.dropped_bytes = 0
    step.started = time.perf_counter()
    return closed.state


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
