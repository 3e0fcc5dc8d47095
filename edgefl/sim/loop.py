"""The in-process round loop: `run_federation` runs the round engine's rounds (edgefl.rounds)
over in-memory clients, training the tasked clients in a thread pool (the C core releases
the GIL), or on the calling thread alone when each client takes too little CPU to pay for
the threads' hand-offs (`_Pace`). Only dispatch and collection are its own: the pool, its
one-hand-off-per-thread work queue (`_map_clients`), and the evaluation of a round deferred
into the next round's pool. Selection, tasks, the upload check, aggregation, the record and the evaluation
schedule are the engine's.

Determinism: selection is seeded by (seed, round), each local round by (seed, round,
client) (`strategies.client_seed`), and aggregation visits clients in sorted order, so the
final model is bit-identical whatever the number of worker threads or their scheduling.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping

import numpy as np

from ..errors import NonFiniteError, RunStopped, TrainingStopped, budget_stop
from ..privacy import NO_HOOKS, BudgetExhausted, PrivacyHooks
from ..privacy.hooks import task_generator
from ..rounds import RoundEngine, add_evaluation, client_contribution
from ..runs.prepare import RunResult
from ..strategies import LocalData, Setup, Strategy

__all__ = ["run_federation"]


def run_federation(strategy: Strategy, init_params: np.ndarray, clients: Mapping[int, LocalData],
                   setup: Setup, clients_per_round: int, *, rounds: int | None = None,
                   test: tuple | None = None, eval_every: int = 1, workers: int | None = None,
                   on_round: Callable[[dict], None] | None = None,
                   on_model: Callable[[int, np.ndarray], None] | None = None,
                   summing: bool = False, hooks: PrivacyHooks = NO_HOOKS,
                   secure_sum: Callable | None = None, clock=None,
                   stop=None) -> RunResult:
    """Run `rounds` (default setup.rounds) rounds of `strategy` over in-memory `clients`.

    The rounds are the round engine's (edgefl.rounds): each selects `clients_per_round` of
    setup.clients, trains every client the strategy tasks (FedUmf tasks unselected clients
    too) -- here, in a pool of `workers` threads, or on the calling thread alone when the
    clients are too small to gain from threads (`_Pace`) --, passes the uploads of tasks
    with upload=True to `aggregate` in sorted client order, and evaluates the global model
    on `test` = (x, y) every `eval_every` rounds and after the last. `on_round(record)` sees
    each round's metrics once it is done and evaluated (with several threads a round's
    evaluation overlaps the next round's training, so its record comes then; records still
    come in round order), `on_model(round, global model)` its model as soon as it is
    aggregated (the periodic ONNX export).

    summing: the rounds sum (edgefl.privacy's docstring): each client turns its update into
    a contribution (`rounds.client_contribution`, DP's `hooks.client_delta` with a Generator
    seeded from its task's seed, so a simulation is reproducible -- a board draws its own),
    and the round closes from their sum: `secure_sum(engine, plan, contributions)` ->
    (SumTotal, UploadTotals, extras) when given (secure aggregation), else the clear sum.
    A secure_sum with `begin(engine, plan, training clients, clients)` has it called as each
    round opens; what it returns, if not None, gets (client, contribution) as each exists;
    its `close()` is called when the run ends (edgefl.sim.secure: phases during training).
    `hooks.before_round` (before a round opens) or `hooks.server_sum` raising
    privacy.BudgetExhausted ends the run after the round before;
    the result's `stopped` says why.

    clock: a sim.clock.Clock of the run's `sim_fleet:`, or None. Given, each round lasts as long
    as its slowest uploader (or the fleet's deadline: an uploader not done by then is not
    trained and its update is lost), and each record gains sim_time_s (the simulated time
    at the round's end) and late (how many uploaders missed the deadline).

    `stop`: a kernels.StopFlag (the clients' LocalData carry it to the kernel, prepare_run
    puts it there). Once it is set, the local rounds stop before their next step and
    RunStopped is raised with the rounds done (each evaluated and passed to on_round); the
    round in progress is dropped.
    """
    rounds = setup.rounds if rounds is None else rounds
    covers = getattr(clients, "covers", None)       # runs.prepare.ShardClients: no set of N
    missing = [] if covers is not None and covers(setup.clients) else \
        sorted(set(setup.clients) - set(clients))
    if missing:
        raise ValueError(f"run_federation: no local data for client(s) {missing[:10]}")
    model = clients[setup.clients[0]].model
    if not setup.units:   # the server knows the architecture (FedMR recombines per layer)
        setup = dataclasses.replace(setup, units=Setup.units_of(model))
    workers = (os.cpu_count() or 1) if workers is None else int(workers)
    if workers < 1:
        raise ValueError(f"workers = {workers}: need at least 1 thread")
    engine = RoundEngine.for_run(strategy, setup, model, clients_per_round, rounds=rounds,
                                 eval_every=eval_every, test=test)
    state = strategy.init(init_params, setup)
    client_states: dict = {}        # {client: State} of the clients that trained (None: not)
    history = []
    started = time.perf_counter()
    # workers - 1 pool threads: the calling thread trains clients too
    pool = ThreadPoolExecutor(max_workers=workers - 1, thread_name_prefix="edgefl-client") \
        if workers > 1 else None
    # With more than one thread, the evaluation of round r's model runs as one more work item
    # of round r+1's training phase instead of between the rounds, where it kept all but one
    # core idle (issue #3's overhead target); its record reaches on_round when that phase
    # ends. The last round is evaluated at once. The model is the read-only State buffer of
    # round r, so the result is the same either way.
    pending = None                  # the ClosedRound whose evaluation is deferred
    pace = _Pace()                  # whether the clients are worth the pool's threads
    stopped = None                  # why the run ended early (errors.budget_stop), if it did
    sim_time = 0.0

    def finish(record) -> None:
        history.append(record)
        if on_round is not None:
            on_round(record)

    def run_stopped(r):
        if pending is not None:        # the round before this one was aggregated: record it
            add_evaluation(pending.record, engine.evaluate(pending.model, pending.state))
            finish(pending.record)
        return RunStopped(r, RunResult(state, client_states, history,
                                       strategy.global_model(state)), rounds)

    try:
        for r in range(1, rounds + 1):
            if stop is not None and stop.is_set():
                raise run_stopped(r)
            try:
                hooks.before_round(r)      # a spent DP budget ends the run before training
            except BudgetExhausted as exc:
                stopped = budget_stop(exc, r, rounds)
                break
            plan = engine.open_round(r, state)
            tasks = plan.tasks
            order = sorted(tasks)
            clock_extras = None
            if clock is not None:
                seconds = {c: clock.task_seconds(c, tasks[c], clients[c].num_samples)
                           for c in plan.uploaders}
                duration, late = clock.round_seconds(r, seconds)
                order = [c for c in order if c not in late]
                sim_time += duration
                clock_extras = {"sim_time_s": sim_time, "late": len(late)}
            evaluating = pending
            # a secure sum may run its first phases during training, and take each
            # contribution as it comes (edgefl.sim.secure)
            ahead = secure_sum.begin(engine, plan, order, clients) \
                if summing and hasattr(secure_sum, "begin") else None

            def work_item(c, r=r, tasks=tasks, evaluating=evaluating, ahead=ahead):
                if c is _EVALUATE:
                    return engine.evaluate(evaluating.model, evaluating.state)
                try:
                    update, new_state = strategy.train(tasks[c], clients[c], client_states.get(c))
                    if summing and tasks[c].upload:
                        contribution = client_contribution(
                            strategy, tasks[c], update, hooks, task_generator(tasks[c]))
                        if ahead is not None:
                            ahead(c, contribution)
                        return update, new_state, contribution
                    return update, new_state, None
                except NonFiniteError as exc:
                    raise NonFiniteError(exc.step, f"round {r}, client {c}: {exc}") from exc

            t1 = time.perf_counter()
            try:
                if pool is None:
                    results = [work_item(c) for c in
                               (order if evaluating is None else [_EVALUATE] + order)]
                else:
                    results = _pooled_round(pool, workers, work_item, order,
                                            evaluating is not None, pace)
            except TrainingStopped:
                raise run_stopped(r) from None
            train_wall = time.perf_counter() - t1
            if evaluating is not None:
                pending = None
                add_evaluation(evaluating.record, results[0])
                finish(evaluating.record)
                results = results[1:]
            updates, contributions = {}, {}
            uploaders = plan.uploaders
            for c, (update, new_state, contribution) in zip(order, results):
                if new_state is not None or c in client_states:
                    client_states[c] = new_state
                # (an uploader's update is accepted as it is: accept_upload only refuses
                # buffers from the others)
                if c in uploaders or engine.accept_upload(plan, c, update):
                    updates[c] = update
                    contributions[c] = contribution
            timing = dict(train_wall_s=train_wall, elapsed_before=plan.started - started,
                          defer_evaluation=pool is not None and r != rounds)
            try:
                if not summing:
                    closed = engine.close_round(
                        plan, updates, state, **timing,
                        extras=None if clock_extras is None else clock_extras.copy)
                elif secure_sum is None:
                    closed = engine.close_round_clear_sum(
                        plan, contributions, state, hooks=hooks, **timing,
                        extras=None if clock_extras is None else clock_extras.copy)
                else:
                    total, totals, extras = secure_sum(engine, plan, contributions)
                    extras = {**extras, **(clock_extras or {})}
                    closed = engine.close_round_from_sum(plan, total, totals, state,
                                                         hooks=hooks, extras=lambda: extras,
                                                         **timing)
            except BudgetExhausted as exc:
                stopped = budget_stop(exc, r, rounds)
                break
            # the round's client models are aggregated: free them now, not when the next
            # round's replace them, so that round's training reuses their memory instead of
            # growing the heap to two rounds' worth (1,000 clients: 31 MB of page faults)
            results = updates = contributions = None
            state = closed.state
            if closed.evaluation_pending:
                pending = closed
            else:
                finish(closed.record)
            if on_model is not None:
                on_model(r, closed.model)
        if pending is not None:      # the run stopped early with a deferred evaluation
            add_evaluation(pending.record, engine.evaluate(pending.model, pending.state))
            finish(pending.record)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        if hasattr(secure_sum, "close"):      # a secure round begun and never summed
            secure_sum.close()
    return RunResult(state, client_states, history, strategy.global_model(state), stopped)


_EVALUATE = object()      # the work item of run_federation's deferred evaluation


class _Pace:
    """Whether a run's clients train on the pool's threads or on the calling thread alone.

    A thread releases the interpreter lock for the C part of each local round and must win it
    back for the Python part around it (the task, the copy, the Update: ~15 us a client). When
    the C part is as short as that -- 6-image shards, one step -- the threads only queue for
    the lock, each hand-off a wake-up of the other thread: at 10,000 clients, 1,000 a round,
    a round took 82 ms on two threads on a quiet machine against ~45 ms of CPU (issue 19,
    item 1). So the calling thread trains the run's first clients alone, timing them
    (thread CPU time, so waiting and load do not count): if PROBE of them take less than
    ALONE_BELOW * PROBE in all, the run stays on the calling thread; as soon as the clients
    timed have taken that much, the rest of the round and the run's later rounds use the pool.
    Which thread trains a client never changes the result (run_federation's docstring);
    the deferred evaluation, one long C call, still overlaps the training on a pool thread."""
    ALONE_BELOW = 40e-6     # s of CPU a client; measured per client (thread CPU, median):
    # 16 us at 10,000 clients (6 images), 57 us at 1,000 (60 images), 470 us at 100
    PROBE = 16              # clients timed before the run stays on the calling thread
    clock = staticmethod(time.thread_time)

    def __init__(self):
        self.alone: bool | None = None      # None: not decided yet
        self.timed, self.cpu = 0, 0.0

    def probe(self, fn: Callable, items: list) -> list:
        """[fn(item) for item in items] on the calling thread, in order, timing each while
        undecided; stops early (a shorter list) when the budget runs out, the rest being
        the pool's."""
        budget = self.ALONE_BELOW * self.PROBE
        clock, results = self.clock, []
        for item in items:
            if self.alone is None:
                t = clock()
                results.append(fn(item))
                self.cpu += clock() - t
                self.timed += 1
                if self.cpu >= budget:
                    self.alone = False
                    break
                if self.timed >= self.PROBE:
                    self.alone = True
            else:
                results.append(fn(item))
        return results


def _pooled_round(pool: ThreadPoolExecutor, workers: int, fn: Callable, order: list,
                  evaluate: bool, pace: _Pace) -> list:
    """[fn(_EVALUATE)] if `evaluate`, then [fn(c) for c in order], with the pool: the
    evaluation on a pool thread, the clients on the pool's threads and the calling thread
    (`_map_clients`) or on the calling thread alone (`_Pace`). As with `_map_clients`, when
    items fail the earliest one's error is raised (the evaluation's first)."""
    side = pool.submit(fn, _EVALUATE) if evaluate else None
    try:
        if pace.alone is False:
            results = _map_clients(pool, workers, fn, order)
        elif pace.alone:
            results = [fn(c) for c in order]
        else:
            results = pace.probe(fn, order)
            results += _map_clients(pool, workers, fn, order[len(results):])
    except BaseException:
        if side is not None and side.exception() is not None:   # waits for the evaluation
            raise side.exception() from None
        raise
    return results if side is None else [side.result()] + results


def _map_clients(pool: ThreadPoolExecutor | None, workers: int, fn: Callable, items: list) -> list:
    """[fn(item) for item in items] on `workers` threads: the pool's and the caller's.

    Each thread takes the next unclaimed item until none is left, so a round costs one
    hand-off per thread instead of one future per client (pool.map's ~20 us each was ~6% of a
    digits round). The result list is in item order whatever thread computed what, and when
    clients fail the one earliest in `items` is raised, so errors are deterministic too."""
    if pool is None or len(items) < 2:
        return [fn(item) for item in items]
    results: list = [None] * len(items)
    errors: dict = {}
    claim = itertools.count()          # next() on a count is atomic under the GIL

    def work() -> None:
        for i in iter(claim.__next__, None):
            if i >= len(items):
                return
            try:
                results[i] = fn(items[i])
            except BaseException as exc:      # re-raised below, on the calling thread
                errors[i] = exc

    helpers = [pool.submit(work) for _ in range(min(workers, len(items)) - 1)]
    work()
    for future in helpers:
        future.result()
    if errors:
        raise errors[min(errors)]
    return results
