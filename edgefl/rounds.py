"""The round engine: one federated round, written once for every way of reaching the clients.

A round has three steps, and only the middle one depends on where the clients are:

    engine = RoundEngine.for_run(strategy, setup, model, clients_per_round, test=(x, y))
    plan = engine.open_round(r, state)          # selection, tasks, who may upload
    ... dispatch plan.tasks, collect updates ...
    closed = engine.close_round(plan, updates, state, train_wall_s=...)
    state, record = closed.state, closed.record

`edgefl simulate` (`sim.run_federation`) dispatches to a thread pool and collects the
functions' results; the MQTT aggregator (`roles.aggregator`) announces the round on its topic
and collects updates from the update topics until the round closes. Everything else is
decided here: the selection (`select_clients`, seeded by (seed, round) alone), the tasks
(`strategy.configure`), which clients may upload (`RoundPlan.upload_refusal`, the one check
both callers apply), aggregation in sorted client order, the evaluation schedule
(`evaluation_due`: every `eval_every` rounds and after the last), and the round's record
(`round_record`, the one function that builds it). Because both callers go through the same
steps with the same inputs, a round over a broker ends with the in-process round's model bit
for bit, and a change to what a round is made here reaches both.

The record (a line of metrics.jsonl), its keys in this order:

    round, test_accuracy, test_loss    (null on rounds not evaluated)
    train_loss      the strategy's metric of that name, else the mean over the uploaders'
                    local steps (`strategies.mean_train_loss`)
    uplink_bytes    float32 bytes of the buffers aggregated
    downlink_bytes  float32 bytes of the tasks' buffers, summed over the clients tasked
    selected        the selected client ids, sorted
    trained         how many clients were tasked (FedUmf tasks unselected clients too)
    wall_s          seconds from opening the round to its record (evaluation included when
                    it was not deferred)
    train_wall_s    the caller's parallel phase: the thread pool's span in process, the
                    slowest client's local training over MQTT
    elapsed_s       seconds of the run so far, earlier rounds (and earlier processes of a
                    resumed run) included
    ...             the strategy's metrics, then the caller's own fields (`extras`: the
                    aggregator's closed_by, updates, missing and message counts)

Evaluation is a step of its own so a caller may overlap it with other work: with
`defer_evaluation` the record comes back with `ClosedRound.evaluation_pending` set and the
caller evaluates `closed.model` when it likes (`evaluate`) and fills the record in with
`add_evaluation` (simulate runs it as one more work item of the next round's thread pool).
The model is a read-only State buffer, so the result is the same whenever it runs.

The round variants, and why the engine is cut where it is:

- A plan is a plain value between two calls, not a loop the engine owns: the caller decides
  when a round closes (all uploaders in, a quorum, a deadline -- the aggregator's rules) and
  may hold several plans at once. Buffered asynchronous rounds (FedBuff: a server step once
  K updates have arrived, each possibly trained on a model some steps old) are such a
  caller (`edgefl/sim/asynchronous.py`): it refills idle clients with `open_round(r, state,
  among=idle, count=n, draw=j)` and closes step r with `close_buffer`, which checks each
  update against the plan that tasked it (`upload_refusal` is per plan); the staleness
  weighting is the strategy's, with the task's version carried in the update's scalars.
- Closing is two steps: `aggregate` (with `UploadTotals.of`, the only code that reads
  per-client updates) and `record_round`, which takes the new state, the strategy's metrics
  and the `UploadTotals` -- never the updates. Secure aggregation (the aggregator sees
  masked vectors and learns only their weighted sum) replaces the first step, as below;
  selection, the upload check, evaluation and the record stay as they are. (It cannot use
  `on_unusable`: a sum has no per-client part to drop; the protocol's own dropout handling
  takes that place.)
- Rounds that sum (secure aggregation, DP; edgefl.privacy's docstring draws the whole
  path): each client turns its update into a `Contribution` (`client_contribution`, with
  DP's client hook), the server gets their sum -- in the clear (`sum_clear`, sorted client
  order) or unmasked by the secure aggregation protocol -- and `close_round_from_sum`
  applies DP's server hook, the strategy's `aggregate_sum` and `record_round`. The record's
  train_loss comes from two scalars every contribution carries (`LOSS_SCALARS`), so it too
  is computed from the sum.
- Partial aggregates from edge aggregators (edgefl/roles/edge.py: one upload stands for
  a site's clients): an edge is a caller of `sum_clear` for its own clients, with the
  contributions the centre's tasks define, and forwards that SumTotal; the centre adds the
  edges' partial sums (`sum_partials`) and closes the round with `close_round_from_sum`, as
  a DP round does, so only the `secure_sum` strategies run in two levels. The model equals
  the flat run's up to float32 rounding of the partial sums (docs/scaling.md).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from . import kernels
from .privacy.hooks import NO_HOOKS, PrivacyHooks
from .strategies import (Contribution, Setup, State, Strategy, StrategyError, SumTotal, Task,
                         Update, mean_train_loss, select_clients)

__all__ = ["RoundEngine", "RoundPlan", "ClosedRound", "UploadTotals", "UploadRefused",
           "round_record", "add_evaluation", "client_contribution", "LOSS_SCALARS"]

# the scalars every contribution carries so a summing round's record has its train_loss:
# sum_i loss_i * steps_i and sum_i steps_i (the mean over all local steps, mean_train_loss's)
LOSS_SCALARS = ("train_loss_x_steps", "train_steps")


def client_contribution(strategy: Strategy, task: Task, update: Update,
                        hooks: PrivacyHooks = NO_HOOKS,
                        rng: np.random.Generator | None = None) -> Contribution:
    """The client's side of a summing round: `strategy.contribution(task, update)`, its
    vector passed through DP's `hooks.client_delta` (before the weight is folded in and
    before any masking), plus the `LOSS_SCALARS`. `rng`: the Generator handed to the hook
    (None: a fresh one from the OS's entropy, which the server cannot know)."""
    contribution = strategy.contribution(task, update)
    vector = contribution.vector
    if hooks is not NO_HOOKS:
        vector = hooks.client_delta(np.array(vector, copy=True),
                                    np.random.default_rng() if rng is None else rng)
    clash = [k for k in LOSS_SCALARS if k in contribution.scalars]
    if clash:
        raise StrategyError(f"{strategy.name}: contribution scalars {clash} are the round "
                            f"engine's")
    scalars = dict(contribution.scalars)
    scalars[LOSS_SCALARS[0]] = update.train_loss * update.steps
    scalars[LOSS_SCALARS[1]] = float(update.steps)
    return Contribution(vector, contribution.weight, scalars)


class UploadRefused(RuntimeError):
    """An update from a client whose task this round allows no upload."""


@dataclass(frozen=True)
class RoundPlan:
    """An opened round: what the server asked of whom.

    round:     the round number, 1..rounds.
    selected:  the clients `select_clients` chose, sorted.
    tasks:     {client: Task} from `strategy.configure`: every client that trains this round
               (FedUmf tasks unselected clients too, with upload=False).
    uploaders: the clients whose task allows an upload.
    started:   time.perf_counter() when the round opened; its wall_s counts from here.
    """
    round: int
    selected: tuple
    tasks: Mapping[int, Task]
    uploaders: frozenset
    started: float

    def upload_refusal(self, client: int, who: str | None = None) -> str | None:
        """Why `client` may not upload this round, or None when it may: the one upload
        check, applied by simulate to each result and by the aggregator to each update
        frame. `who` names the client in the reason (the aggregator's node id)."""
        if client in self.uploaders:
            return None
        who = f"client {client}" if who is None else who
        if client in self.tasks:
            return (f"round {self.round}: {who} was not selected to upload this round "
                    f"(FedUmf: only authorised clients upload)")
        return f"round {self.round}: {who} has no task this round"


@dataclass(frozen=True)
class UploadTotals:
    """What a round's record says of its uploads, without the uploads themselves (a secure
    sum or an edge aggregator's partial aggregate gives these, not per-client updates).

    nbytes:     float32 bytes of the buffers aggregated (the record's uplink_bytes).
    train_loss: the record's train_loss (`of` says which).
    """
    nbytes: int
    train_loss: float

    @classmethod
    def of(cls, updates: Mapping[int, Update], metrics: Mapping) -> "UploadTotals":
        """The totals of `updates` aggregated with these strategy `metrics`: train_loss is
        the strategy's metric of that name (e.g. over the updates a robust aggregation
        accepted), else the mean over the uploaders' local steps (`mean_train_loss`)."""
        nbytes = 0          # (a loop, not sum over a generator: one term per client)
        for u in updates.values():
            nbytes += u.nbytes
        return cls(nbytes, metrics["train_loss"] if "train_loss" in metrics
                   else mean_train_loss(updates))


    @classmethod
    def of_sum(cls, total: SumTotal, nbytes: int) -> "UploadTotals":
        """The totals of a summing round: `nbytes` of what came up (masked vectors, or the
        clear contributions), train_loss from the sum's `LOSS_SCALARS`."""
        steps = total.scalars.get(LOSS_SCALARS[1], 0.0)
        loss = total.scalars.get(LOSS_SCALARS[0], float("nan")) / steps if steps > 0 \
            else float("nan")
        return cls(int(nbytes), float(loss))


@dataclass(frozen=True)
class ClosedRound:
    """A closed round: the new server state, its global model, and the round's record.
    With `evaluation_pending` the round is due an evaluation the caller deferred: evaluate
    `model` and `add_evaluation(record, ...)` before the record is published."""
    state: State
    model: np.ndarray
    record: dict
    evaluation_pending: bool = False


def round_record(plan: RoundPlan, totals: UploadTotals, metrics: Mapping, *, wall_s: float,
                 train_wall_s: float, elapsed_s: float, evaluation: Mapping | None = None,
                 extras: Mapping | None = None) -> dict:
    """The record of round `plan.round`: the one function that builds it (the module
    docstring lists its keys). `metrics` are the strategy's, merged after the timings (their
    train_loss is `totals.train_loss` already); `extras`, the caller's own fields, come last;
    `evaluation` is `kernels.evaluate_samples`'s result, or None (not evaluated, or
    deferred)."""
    record = {"round": plan.round, "test_accuracy": None, "test_loss": None,
              "train_loss": totals.train_loss, "uplink_bytes": totals.nbytes,
              "downlink_bytes": downlink_bytes(plan.tasks),
              "selected": list(plan.selected), "trained": len(plan.tasks),
              "wall_s": wall_s, "train_wall_s": train_wall_s, "elapsed_s": elapsed_s}
    for key, value in metrics.items():
        if key != "train_loss":
            record[key] = value
    if extras:
        record.update(extras)
    if evaluation is not None:
        add_evaluation(record, evaluation)
    return record


def downlink_bytes(tasks: Mapping[int, Task]) -> int:
    """The record's downlink_bytes: sum of the tasks' nbytes, each distinct buffers mapping
    sized once (a round's tasks share one, `Task.shared`: a sum over 1,000 clients of
    the same few buffers' sizes was ~1 us each)."""
    total, sizes = 0, {}
    for task in tasks.values():
        buffers = task.buffers
        size = sizes.get(id(buffers))         # (the tasks hold the mappings alive meanwhile)
        if size is None:
            size = sizes[id(buffers)] = task.nbytes
        total += size
    return total


def add_evaluation(record: dict, evaluation: Mapping) -> None:
    """Fill a record's test_accuracy and test_loss in from `kernels.evaluate_samples`
    (and member_accuracy from `RoundEngine.evaluate`, when it gives one)."""
    record["test_accuracy"], record["test_loss"] = evaluation["accuracy"], evaluation["loss"]
    if "member_accuracy" in evaluation:
        record["member_accuracy"] = list(evaluation["member_accuracy"])


@dataclass(frozen=True)
class RoundEngine:
    """The rounds of one run: what they share, and the steps of each.

    strategy, setup:   the algorithm and the server's view of the run (setup.units filled in).
    clients_per_round: how many clients `select_clients` picks each round.
    rounds:            the run's last round (the one always evaluated).
    eval_every:        evaluate every this many rounds (and after the last).
    test_set:          kernels.Samples to evaluate on (checked once per run), or None.
    """
    strategy: Strategy
    setup: Setup
    clients_per_round: int
    rounds: int
    eval_every: int = 1
    test_set: kernels.Samples | None = None

    def __post_init__(self):
        for name, low in (("rounds", 0), ("eval_every", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                    or value < low:
                raise ValueError(f"{name} = {value!r}: need an integer >= {low}")

    @classmethod
    def for_run(cls, strategy: Strategy, setup: Setup, model, clients_per_round: int, *,
                rounds: int | None = None, eval_every: int = 1,
                test: tuple | None = None) -> "RoundEngine":
        """The engine of a run; `test` = (x, y) is checked against `model` here, once."""
        return cls(strategy, setup, clients_per_round,
                   setup.rounds if rounds is None else rounds, eval_every,
                   None if test is None else kernels.Samples(model, *test))

    # ------------------------------------------------------------------ opening
    def open_round(self, r: int, state: State, *, among=None, count: int | None = None,
                   draw: int = 0) -> RoundPlan:
        """Select round r's clients and ask the strategy for their tasks.

        among, count, draw: an asynchronous caller's refill (`close_buffer`): `count` of the
        idle clients `among`, select_clients' draw `draw` of round r; the defaults are the
        synchronous round's clients_per_round of every client, draw 0."""
        started = time.perf_counter()
        selected = select_clients(self.setup.seed, r,
                                  self.setup.clients if among is None else among,
                                  self.clients_per_round if count is None else count, draw)
        tasks = self.strategy.configure(r, selected, state)
        return RoundPlan(r, tuple(selected), tasks,
                         frozenset(c for c, t in tasks.items() if t.upload), started)

    def accept_upload(self, plan: RoundPlan, client: int, update: Update) -> bool:
        """Whether `update`, the result of `client`'s task, goes into the aggregate: True
        for an uploader, False for a client that trained without uploading. An update with
        buffers from a client not allowed to upload raises UploadRefused naming the client
        and the round."""
        refusal = plan.upload_refusal(client)
        if refusal is None:
            return True
        if update.buffers:
            raise UploadRefused(f"{self.strategy.name}: {refusal}, but its update carries "
                                f"buffers {sorted(update.buffers)}")
        return False

    # ------------------------------------------------------------------ closing
    def evaluation_due(self, r: int) -> bool:
        """Whether round r's model is evaluated: every eval_every rounds and the last."""
        return self.test_set is not None and (r % self.eval_every == 0 or r == self.rounds)

    def evaluate(self, model: np.ndarray, state: State | None = None) -> dict:
        """{accuracy, loss} of `model` on the test set; with the round's `state`, also
        member_accuracy: the accuracy of each model the strategy names besides the global
        one (`Strategy.evaluated_members`, e.g. FedMR's K models), when it names any."""
        result = kernels.evaluate_samples(self.test_set, model)
        members = None if state is None else self.strategy.evaluated_members(state)
        if members is not None:
            result["member_accuracy"] = [kernels.evaluate_samples(self.test_set, m)["accuracy"]
                                         for m in members]
        return result

    def aggregate(self, r: int, updates: dict, state: State,
                  on_unusable: Callable[[int, StrategyError], None] | None = None):
        """(new state, metrics) of round r from `updates` ({client: Update}), visited in
        sorted client order by the strategy.

        on_unusable: None, and a StrategyError propagates (in process it is a bug). Given,
        the updates the strategy cannot use on their own are found, each reported as
        on_unusable(client, error) and deleted from `updates`, and the rest aggregated; if
        none or all of them are unusable the error is raised, naming the round."""
        if on_unusable is None:
            return self.strategy.aggregate(r, updates, state)
        try:
            return self.strategy.aggregate(r, updates, state)
        except StrategyError as exc:
            bad = {}
            for c, u in sorted(updates.items()):
                try:
                    self.strategy.aggregate(r, {c: u}, state)
                except StrategyError as single:
                    bad[c] = single
            if not bad or len(bad) == len(updates):
                raise StrategyError(f"round {r}: aggregation failed: {exc}") from exc
            for c, why in bad.items():
                on_unusable(c, why)
                del updates[c]
            return self.strategy.aggregate(r, updates, state)

    def close_round(self, plan: RoundPlan, updates: dict, state: State, *,
                    train_wall_s: float, elapsed_before: float = 0.0,
                    defer_evaluation: bool = False,
                    on_unusable: Callable[[int, StrategyError], None] | None = None,
                    extras: Callable[[], Mapping] | None = None) -> ClosedRound:
        """Aggregate `updates` (`aggregate`; with on_unusable, the ones it drops are deleted
        from the dict) and `record_round` the result."""
        state, metrics = self.aggregate(plan.round, updates, state, on_unusable)
        return self.record_round(plan, state, metrics, UploadTotals.of(updates, metrics),
                                 train_wall_s=train_wall_s, elapsed_before=elapsed_before,
                                 defer_evaluation=defer_evaluation, extras=extras)

    def sum_clear(self, contributions: Mapping[int, Contribution], r: int | None = None) \
            -> SumTotal:
        """The sum of `contributions` ({client: Contribution}) in the clear, in sorted client
        order: sum_i weight_i * vector_i (kernels.weighted_sum: float64 accumulation, one
        rounding to float32), and the weights' and scalars' sums. A DP-only round's sum; a
        secure round's must equal it within the quantisation bound."""
        clients, first, names = _matching(contributions, r, "contributions",
                                          lambda c: f"client {c}'s contribution")
        vector = np.empty(first.vector.size, np.float32)
        kernels.weighted_sum(vector, [contributions[c].vector for c in clients],
                             [float(contributions[c].weight) for c in clients])
        scalars = {k: float(sum(contributions[c].scalars[k] for c in clients)) for k in names}
        return SumTotal(vector, sum(contributions[c].weight for c in clients), scalars,
                        len(clients))

    def sum_partials(self, partials: Mapping, r: int | None = None) -> SumTotal:
        """The sum of partial sums ({key: SumTotal}, e.g. each edge aggregator's `sum_clear`
        of its own clients), in sorted key order: the vectors added by kernels.weighted_sum
        with weight 1 (float64 accumulation, one rounding to float32), the weights, scalars
        and counts added. Equal to `sum_clear` over all the clients up to float32 rounding:
        each partial was rounded once on its own (docs/scaling.md gives the bound)."""
        keys, first, names = _matching(partials, r, "partial sums",
                                       lambda k: f"the partial sum of {k}")
        vector = np.empty(first.vector.size, np.float32)
        kernels.weighted_sum(vector, [partials[k].vector for k in keys], [1.0] * len(keys))
        scalars = {n: float(sum(partials[k].scalars[n] for k in keys)) for n in names}
        return SumTotal(vector, sum(partials[k].weight for k in keys), scalars,
                        sum(partials[k].count for k in keys))

    def close_round_from_sum(self, plan: RoundPlan, total: SumTotal, totals: UploadTotals,
                             state: State, *, hooks: PrivacyHooks = NO_HOOKS,
                             train_wall_s: float, elapsed_before: float = 0.0,
                             defer_evaluation: bool = False,
                             extras: Callable[[], Mapping] | None = None) -> ClosedRound:
        """Close a summing round from the sum of its contributions: DP's `hooks.server_sum`
        (which may raise privacy.BudgetExhausted: nothing is applied), the strategy's
        `aggregate_sum`, then `record_round` with `totals` (`UploadTotals.of_sum`) and the
        hooks' `round_metrics` after the strategy's."""
        total = hooks.server_sum(total, plan.round)
        state, metrics = self.strategy.aggregate_sum(plan.round, total, state)
        metrics = dict(metrics)
        metrics.update(hooks.round_metrics(plan.round))
        # a DP budget that refuses the next round makes this one the run's last: evaluated
        # as the planned last round is, so the run's final accuracy is its final model's
        # (epsilon depends on the round number alone, and the accountant caches it for the
        # next round's own check)
        last = plan.round < self.rounds and not hooks.allows(plan.round + 1)
        return self.record_round(plan, state, metrics, totals, train_wall_s=train_wall_s,
                                 elapsed_before=elapsed_before,
                                 defer_evaluation=defer_evaluation, extras=extras, last=last)

    def close_round_clear_sum(self, plan: RoundPlan, contributions: Mapping[int, Contribution],
                              state: State, *, hooks: PrivacyHooks = NO_HOOKS,
                              train_wall_s: float, elapsed_before: float = 0.0,
                              defer_evaluation: bool = False,
                              extras: Callable[[], Mapping] | None = None) -> ClosedRound:
        """A DP-only round: `sum_clear` the contributions and `close_round_from_sum`; the
        record's uplink_bytes are the contributions' float32 vectors."""
        total = self.sum_clear(contributions, plan.round)
        nbytes = sum(c.vector.nbytes for c in contributions.values())
        return self.close_round_from_sum(plan, total, UploadTotals.of_sum(total, nbytes), state,
                                         hooks=hooks, train_wall_s=train_wall_s,
                                         elapsed_before=elapsed_before,
                                         defer_evaluation=defer_evaluation, extras=extras)

    def close_buffer(self, r: int, buffer, tasked, state: State, *, started: float,
                     train_wall_s: float, elapsed_before: float = 0.0,
                     defer_evaluation: bool = False,
                     extras: Callable[[], Mapping] | None = None) -> ClosedRound:
        """Asynchronous rounds (FedBuff): server step r from `buffer`, the updates that came
        in since step r-1 as (plan, client, update) in arrival order, each checked against
        the plan that tasked it (`accept_upload`), possibly an earlier version's. Updates are
        keyed (client, arrival index), so a client back twice in one buffer counts twice and
        aggregation still visits clients in sorted order. `tasked` are the plans opened since
        step r-1 (the record's downlink and `trained`); `started` is when step r-1 closed."""
        updates = {}
        for i, (plan, client, update) in enumerate(buffer):
            if self.accept_upload(plan, client, update):
                updates[(client, i)] = update
        tasks = {(c, i): t for i, plan in enumerate(tasked) for c, t in plan.tasks.items()}
        record_plan = RoundPlan(r, tuple(sorted({c for c, _ in updates})), tasks,
                                frozenset(c for c, _ in updates), started)
        state, metrics = self.aggregate(r, updates, state)
        return self.record_round(record_plan, state, metrics, UploadTotals.of(updates, metrics),
                                 train_wall_s=train_wall_s, elapsed_before=elapsed_before,
                                 defer_evaluation=defer_evaluation, extras=extras)

    def record_round(self, plan: RoundPlan, state: State, metrics: Mapping,
                     totals: UploadTotals, *, train_wall_s: float, elapsed_before: float = 0.0,
                     defer_evaluation: bool = False,
                     extras: Callable[[], Mapping] | None = None,
                     last: bool = False) -> ClosedRound:
        """The global model of `state`, its evaluation when due (unless deferred: then
        ClosedRound.evaluation_pending), and the round's record.

        last:           the run ends after this round before its planned last (a DP
                        budget): its evaluation is due as the planned last round's is.

        train_wall_s:   the caller's parallel phase (see the module docstring).
        elapsed_before: seconds of the run before this round opened.
        extras:         called once aggregation is done, for the caller's own record
                        fields (they may count what aggregation dropped)."""
        model = self.strategy.global_model(state)
        due = self.test_set is not None and (last or self.evaluation_due(plan.round))
        evaluation = self.evaluate(model, state) if due and not defer_evaluation else None
        wall_s = time.perf_counter() - plan.started
        record = round_record(plan, totals, metrics, wall_s=wall_s, train_wall_s=train_wall_s,
                              elapsed_s=elapsed_before + wall_s, evaluation=evaluation,
                              extras=None if extras is None else extras())
        return ClosedRound(state, model, record, due and evaluation is None)


def _matching(items: Mapping, r: int | None, what: str, name) -> tuple:
    """(sorted keys, the first item, its sorted scalar names) of the terms of a sum
    (contributions or partial sums, each with .vector and .scalars), refusing an empty sum
    or a term whose size or scalars differ from the first's, named by `name(key)`."""
    where = f"round {r}: " if r is not None else ""
    keys = sorted(items)
    if not keys:
        raise StrategyError(f"{where}no {what} to sum")
    first = items[keys[0]]
    names = sorted(first.scalars)
    for k in keys:
        got = items[k]
        if got.vector.size != first.vector.size or sorted(got.scalars) != names:
            raise StrategyError(
                f"{where}{name(k)} ({got.vector.size} values, scalars {sorted(got.scalars)}) "
                f"does not match {name(keys[0])} ({first.vector.size} values, scalars {names})")
    return keys, first, names
