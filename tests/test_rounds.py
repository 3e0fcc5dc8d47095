"""The round engine (edgefl/rounds.py): the record's fields and their order, the train-loss
fallback, the evaluation schedule (every eval_every rounds and the last), the upload check
(an update with buffers from a client not allowed to upload is refused, naming the client
and the round), and the same record from both of its callers -- the in-process simulation
and the MQTT aggregator -- for the same run."""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from edgefl import kernels
from edgefl.models import build_model
from edgefl.rounds import (ClosedRound, RoundEngine, RoundPlan, UploadRefused, UploadTotals,
                           add_evaluation, round_record)
from edgefl.roles import Aggregator, AggregatorSettings, Client, ClientSettings, RunPlan, \
    default_client_ids
from edgefl.runs.prepare import prepare_run
from edgefl.sim import run_federation
from edgefl.strategies import Setup, StrategyError, Update, get_strategy, select_clients
from edgefl.strategies.fedumf import FedUmf
from edgefl.transport.loopback import LoopbackBroker
from helpers import load_small_run

TIMING = ("wall_s", "train_wall_s", "elapsed_s")
BASE_KEYS = ["round", "test_accuracy", "test_loss", "train_loss", "uplink_bytes",
             "downlink_bytes", "selected", "trained", "wall_s", "train_wall_s", "elapsed_s"]
AGGREGATOR_KEYS = ["closed_by", "updates", "missing", "late", "duplicates", "rejected",
                   "resends", "announcements", "wire_up_bytes", "wire_down_bytes"]


def small_engine(strategy="fedavg", clients=4, per_round=3, rounds=5, eval_every=1,
                 test=False, **params):
    setup = Setup(clients=range(clients), train={"lr": 0.1}, seed=7, rounds=rounds)
    test_set = None
    if test:
        model = build_model({"name": "softmax"}, (4,), 3)
        x = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
        test_set = kernels.Samples(model, x, np.arange(6, dtype=np.int32) % 3)
    return RoundEngine(get_strategy(strategy, **params), setup, per_round, rounds, eval_every,
                       test_set)


def update(value, samples, loss, steps, n=10):
    return Update({"params": np.full(n, value, np.float32)}, samples, loss, steps)


def test_a_round_opens_with_the_seeded_selection_and_the_strategys_tasks():
    engine = small_engine()
    state = engine.strategy.init(np.zeros(10, np.float32), engine.setup)
    plan = engine.open_round(3, state)
    assert plan.round == 3
    assert list(plan.selected) == select_clients(7, 3, range(4), 3)
    assert sorted(plan.tasks) == list(plan.selected) and plan.uploaders == set(plan.selected)
    assert all(t.round == 3 for t in plan.tasks.values())


@pytest.mark.parametrize("strategy", ["fedavg", "fedumf"])
def test_the_record_has_its_fields_in_order_then_the_strategys_metrics_then_the_callers(
        strategy):
    engine = small_engine(strategy)
    state = engine.strategy.init(np.zeros(10, np.float32), engine.setup)
    plan = engine.open_round(1, state)
    updates = {c: update(c + 1.0, 10 * (c + 1), 0.5 + c, 4 + c) for c in plan.selected}
    closed = engine.close_round(plan, dict(updates), state, train_wall_s=0.25,
                                elapsed_before=10.0,
                                extras=lambda: {"closed_by": "all", "updates": len(updates)})
    assert isinstance(closed, ClosedRound) and not closed.evaluation_pending
    record = closed.record
    expect_state, metrics = engine.strategy.aggregate(1, updates, state)
    extra_metrics = [k for k in metrics if k != "train_loss"]
    assert list(record) == BASE_KEYS + extra_metrics + ["closed_by", "updates"]
    assert strategy == "fedavg" or extra_metrics              # some metrics are merged
    assert record["round"] == 1 and record["test_accuracy"] is None \
        and record["test_loss"] is None
    assert record["train_loss"] == metrics["train_loss"]
    assert record["uplink_bytes"] == 40 * len(updates)              # 10 float32 each
    assert record["downlink_bytes"] == 40 * len(plan.tasks)
    assert record["selected"] == list(plan.selected) and record["trained"] == len(plan.tasks)
    assert all(record[k] == metrics[k] for k in extra_metrics)
    assert record["train_wall_s"] == 0.25 and record["wall_s"] >= 0
    assert record["elapsed_s"] == 10.0 + record["wall_s"]
    assert record["closed_by"] == "all" and record["updates"] == 3
    assert np.array_equal(closed.model, expect_state.buffers["params"])
    assert np.array_equal(closed.state.buffers["params"], expect_state.buffers["params"])


def test_train_loss_is_the_strategys_else_the_mean_over_local_steps():
    plan = RoundPlan(1, (0, 1), {}, frozenset({0, 1}), 0.0)
    updates = {0: update(0.0, 5, 0.5, 2), 1: update(0.0, 5, 1.0, 6)}
    totals = UploadTotals.of(updates, {"tau": 3})
    assert totals.nbytes == 80 and totals.train_loss == pytest.approx((0.5 * 2 + 6.0) / 8)
    assert UploadTotals.of(updates, {"train_loss": 9.0}).train_loss == 9.0
    timing = dict(wall_s=0.0, train_wall_s=0.0, elapsed_s=0.0)
    assert round_record(plan, totals, {"tau": 3}, **timing)["train_loss"] == totals.train_loss
    record = round_record(plan, UploadTotals.of(updates, {"train_loss": 9.0}),
                          {"train_loss": 9.0, "tau": 3}, **timing)
    assert record["train_loss"] == 9.0 and list(record)[-2:] == ["elapsed_s", "tau"]
    # a metric may not move a field: the merge keeps the record's key order
    assert list(round_record(plan, totals, {"round": 1}, **timing)) == BASE_KEYS


def test_evaluation_is_due_every_eval_every_rounds_and_after_the_last():
    engine = small_engine(rounds=8, eval_every=3, test=True)
    assert [r for r in range(1, 9) if engine.evaluation_due(r)] == [3, 6, 8]
    every = small_engine(rounds=4, eval_every=1, test=True)
    assert [r for r in range(1, 5) if every.evaluation_due(r)] == [1, 2, 3, 4]
    blind = small_engine(rounds=4, eval_every=1, test=False)
    assert not any(blind.evaluation_due(r) for r in range(1, 5))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="eval_every"):
            small_engine(eval_every=bad)


def test_a_due_evaluation_is_done_at_once_or_left_to_the_caller():
    engine = small_engine(rounds=2, eval_every=2, test=True, clients=3, per_round=3)
    model = build_model({"name": "softmax"}, (4,), 3)
    state = engine.strategy.init(model.init(0), engine.setup)
    n = model.n_params
    for r, defer in ((1, False), (2, True), (2, False)):
        plan = engine.open_round(r, state)
        updates = {c: update(0.01 * c, 5, 0.5, 1, n) for c in plan.selected}
        closed = engine.close_round(plan, updates, state, train_wall_s=0.0,
                                    defer_evaluation=defer)
        due = r == 2
        assert closed.evaluation_pending == (due and defer)
        assert (closed.record["test_accuracy"] is not None) == (due and not defer)
        if closed.evaluation_pending:
            evaluation = engine.evaluate(closed.model)
            add_evaluation(closed.record, evaluation)
            assert closed.record["test_accuracy"] == evaluation["accuracy"]
            assert closed.record["test_loss"] == evaluation["loss"]


def test_a_non_uploader_with_buffers_is_refused_naming_the_client_and_the_round():
    engine = small_engine(strategy="fedumf", rounds=3)
    state = engine.strategy.init(np.zeros(10, np.float32), engine.setup)
    plan = engine.open_round(2, state)
    quiet = next(c for c, t in sorted(plan.tasks.items()) if not t.upload)   # FedUmf's
    uploader = next(iter(sorted(plan.uploaders)))
    assert engine.accept_upload(plan, uploader, update(1.0, 5, 0.5, 1))
    assert not engine.accept_upload(plan, quiet, Update({}, 5, 0.5, 1))
    with pytest.raises(UploadRefused, match=rf"round 2: client {quiet} was not selected to "
                                            rf"upload.*carries buffers \['params'\]"):
        engine.accept_upload(plan, quiet, update(1.0, 5, 0.5, 1))
    assert plan.upload_refusal(uploader) is None
    assert plan.upload_refusal(quiet, "client-x") == (
        "round 2: client-x was not selected to upload this round (FedUmf: only authorised "
        "clients upload)")
    stranger = RoundPlan(2, (0,), {0: plan.tasks[uploader]}, frozenset({0}), 0.0)
    assert stranger.upload_refusal(5) == "round 2: client 5 has no task this round"


@dataclasses.dataclass(frozen=True)
class _LeakyFedUmf(FedUmf):
    """FedUmf whose client half uploads even when its task says not to."""

    def train(self, task, local_data, client_state):
        return super().train(dataclasses.replace(task, upload=True), local_data, client_state)


def test_simulate_stops_at_a_client_that_uploads_without_permission(tmp_path):
    config = load_small_run(tmp_path, strategy={"name": "fedumf"}, clients_per_round=1)
    run = prepare_run(config, progress=False)
    selected = select_clients(config.seed, 1, run.setup.clients, 1)
    first_quiet = next(c for c in run.setup.clients if c not in selected)
    with pytest.raises(UploadRefused, match=rf"round 1: client {first_quiet} was not "
                                            rf"selected to upload"):
        run_federation(_LeakyFedUmf(), run.init_params, run.clients, run.setup, 1, workers=1)


def _over_loopback(tmp_path, config, run):
    broker = LoopbackBroker()
    ids = default_client_ids(len(run.setup.clients))
    plan = RunPlan(run.strategy, run.init_params, run.setup, run.model,
                   config.clients_per_round, ids, test=(run.dataset.x_test, run.dataset.y_test),
                   eval_every=config.eval_every, description=config.to_dict())
    aggregator = Aggregator(plan, broker.transport("aggregator"), tmp_path / "agg",
                            AggregatorSettings(federation="fed", round_timeout_s=30))
    threads = []
    for c, node in enumerate(ids):
        data = run.clients[c]
        client = Client(ClientSettings(node, "fed", exit_when_finished=True), (data.x, data.y),
                        broker.transport(node), tmp_path / node)
        threads.append(threading.Thread(target=client.run, daemon=True))
        threads[-1].start()
    result = aggregator.run()
    for t in threads:
        t.join(10)
    assert result.finished
    return result


@pytest.mark.parametrize("strategy", ["fedavg", "fedumf"])
def test_simulate_and_the_aggregator_build_the_same_record(tmp_path, strategy):
    config = load_small_run(tmp_path, strategy={"name": strategy}, rounds=3,
                            clients_per_round=2, eval_every=2)
    run = prepare_run(config, progress=False)
    test = (run.dataset.x_test, run.dataset.y_test)
    sims = [run_federation(run.strategy, run.init_params, run.clients, run.setup,
                           config.clients_per_round, test=test, eval_every=config.eval_every,
                           workers=workers).history for workers in (1, 2)]
    over = _over_loopback(tmp_path, config, run).history
    assert [h["test_accuracy"] is not None for h in over] == [False, True, True]

    def untimed(record):
        return [(k, v) for k, v in record.items() if k not in TIMING]

    for r, (one, two, agg) in enumerate(zip(*sims, over), start=1):
        assert untimed(one) == untimed(two)
        assert list(agg)[:len(one)] == list(one)           # the same fields, in order
        assert list(agg)[len(one):] == AGGREGATOR_KEYS     # then the aggregator's own
        assert untimed({k: agg[k] for k in one}) == untimed(one), f"round {r}"
        assert agg["closed_by"] == "all" and agg["missing"] == []


def test_updates_the_strategy_cannot_use_are_dropped_only_when_the_caller_asks():
    engine = small_engine()
    state = engine.strategy.init(np.zeros(10, np.float32), engine.setup)
    odd = Update({"momentum": np.ones(10, np.float32)}, 5, 0.5, 1)     # no "params"
    updates = {0: update(1.0, 5, 0.5, 1), 1: odd, 2: update(3.0, 5, 0.5, 1)}
    with pytest.raises(StrategyError, match="no 'params' buffer"):     # in process: a bug
        engine.aggregate(1, dict(updates), state)
    dropped = []
    kept = dict(updates)
    new, _ = engine.aggregate(1, kept, state, lambda c, why: dropped.append((c, str(why))))
    assert [c for c, _ in dropped] == [1] and "no 'params' buffer" in dropped[0][1]
    assert sorted(kept) == [0, 2]
    expect, _ = engine.strategy.aggregate(1, {0: updates[0], 2: updates[2]}, state)
    assert np.array_equal(new.buffers["params"], expect.buffers["params"])
    with pytest.raises(StrategyError, match="round 1: aggregation failed"):
        engine.aggregate(1, {1: odd}, state, lambda c, why: None)
