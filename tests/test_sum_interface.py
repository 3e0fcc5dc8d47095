"""The sum interface of the strategies that serve secure aggregation and DP
(`Strategy.contribution` / `aggregate_sum`, edgefl/privacy/__init__.py draws the path): for
each one, the server step taken from the clear sum of the round's contributions gives the
model its `aggregate` gives, within float32 rounding, on real data through the real kernels.

Why not bit for bit: `aggregate` averages the clients' models (float64 accumulation, one
rounding), the sum path averages their float32 deltas w_i - w (each delta is rounded once,
the weighted sum once, and the new model w + mean once; FedNova also rounds its division by
||a_i||_1). Each rounding is at most half an ulp of its value and every value is bounded by
the largest |parameter| involved, so the two results differ by a few ulps of that: the test
allows 8 * eps32 * max|w| (eps32 = 2^-23), and the server optimisers, which divide by
sqrt(v) + tau, are compared through their state m (the same bound) and their model with the
bound scaled by eta / tau."""
import numpy as np
import pytest

from edgefl.data import load_dataset, partition
from edgefl.models import build_model
from edgefl.privacy import NO_HOOKS, BudgetExhausted, PrivacyHooks
from edgefl.rounds import LOSS_SCALARS, RoundEngine, UploadTotals, client_contribution
from edgefl.runs.prepare import local_datasets
from edgefl.sim import run_federation
from edgefl.strategies import (Contribution, Setup, StrategyError, SumTotal, get_strategy,
                               mean_train_loss, strategy_names)

EPS32 = float(np.finfo(np.float32).eps)
SERVED = sorted(n for n in strategy_names() if get_strategy(n).secure_sum)
PARAMS = {"fedavg": [{}, {"weighting": "uniform"}], "fednova": [{}, {"weighting": "uniform"}],
          "mfl": [{}], "fedumf": [{}, {"weighting": "samples"}], "fedprox": [{}],
          "fedavgm": [{}], "fedadam": [{}], "fedyogi": [{}]}


@pytest.fixture(scope="module")
def fed():
    ds = load_dataset("digits")
    model = build_model("softmax", ds.input_shape, ds.num_classes)
    # unequal shards, so sample weights differ from a plain mean
    clients = local_datasets(ds, partition(ds, "dirichlet", 5, 3, alpha=0.5), model)
    return model, clients


def test_every_served_strategy_is_covered():
    assert set(SERVED) == set(PARAMS)


def _round(strategy, model, clients, r_state=None, rounds=3):
    """Three rounds, each closed both ways from the same updates: [(clear, summed)]."""
    # varying local steps so FedNova's normalisation matters
    setup = Setup(clients=sorted(clients), train={"lr": 0.1, "batch_size": 16, "epochs": 1},
                  seed=5, rounds=rounds, units=Setup.units_of(model))
    engine = RoundEngine.for_run(strategy, setup, model, 4, rounds=rounds)
    state = strategy.init(model.init(1), setup)
    client_states = {c: None for c in setup.clients}
    out = []
    for r in range(1, rounds + 1):
        plan = engine.open_round(r, state)
        updates, contributions = {}, {}
        for c, task in sorted(plan.tasks.items()):
            update, client_states[c] = strategy.train(task, clients[c], client_states[c])
            if engine.accept_upload(plan, c, update):
                updates[c] = update
                contributions[c] = client_contribution(strategy, task, update)
        clear = engine.close_round(plan, dict(updates), state, train_wall_s=0.0)
        summed = engine.close_round_clear_sum(plan, contributions, state, train_wall_s=0.0)
        out.append((clear, summed, updates, state))
        state = clear.state
    return out


@pytest.mark.parametrize("name, params", [(n, p) for n in SERVED for p in PARAMS[n]])
def test_aggregate_from_the_clear_sum_matches_aggregate(fed, name, params):
    model, clients = fed
    strategy = get_strategy(name, **params)
    for clear, summed, updates, before in _round(strategy, model, clients):
        scale = max(float(np.max(np.abs(b))) for b in before.buffers.values()
                    if b.size) or 1.0
        scale = max(scale, max(float(np.max(np.abs(u.buffers["params"])))
                               for u in updates.values()))
        for key, buf in clear.state.buffers.items():
            bound = 8 * EPS32 * scale
            if name in ("fedadam", "fedyogi") and key != "m":
                # the step eta m / (sqrt(v) + tau) amplifies a difference in m by up to
                # eta / tau; v is squared deltas (its own scale)
                bound *= max(1.0, strategy.eta / strategy.tau)
            diff = float(np.max(np.abs(buf.astype(np.float64)
                                       - summed.state.buffers[key].astype(np.float64))))
            assert diff <= bound, (name, key, diff, bound)
        assert clear.state.meta["round"] == summed.state.meta["round"]
        rec_a, rec_b = clear.record, summed.record
        assert rec_b["train_loss"] == pytest.approx(mean_train_loss(updates), rel=1e-12)
        assert set(rec_a) == set(rec_b)
        if name == "fednova":
            assert rec_b["tau_eff"] == pytest.approx(rec_a["tau_eff"], rel=1e-12)
        if name == "fedumf":
            assert rec_b["fused"] == len(rec_a["fused"])


def test_sum_clear_is_the_weighted_sum_in_client_order():
    engine = RoundEngine(get_strategy("fedavg"), Setup(clients=range(3)), 3, 1)
    rng = np.random.default_rng(0)
    vecs = {c: rng.standard_normal(7).astype(np.float32) for c in (2, 0, 1)}
    contribs = {c: Contribution(v, c + 1, {"a": float(c)}) for c, v in vecs.items()}
    total = engine.sum_clear(contribs)
    want = sum((c + 1) * vecs[c].astype(np.float64) for c in (0, 1, 2)).astype(np.float32)
    assert np.array_equal(total.vector, want)
    assert total.weight == 6 and total.scalars == {"a": 3.0} and total.count == 3


def test_mismatched_contributions_and_bad_values_are_refused():
    engine = RoundEngine(get_strategy("fedavg"), Setup(clients=range(3)), 3, 1)
    a = Contribution(np.zeros(4, np.float32), 1)
    with pytest.raises(StrategyError, match="round 2: client 1's contribution .5 values"):
        engine.sum_clear({0: a, 1: Contribution(np.zeros(5, np.float32), 1)}, 2)
    with pytest.raises(StrategyError, match="no contributions"):
        engine.sum_clear({})
    with pytest.raises(StrategyError, match="whole number"):
        Contribution(np.zeros(4, np.float32), 1.5)
    with pytest.raises(StrategyError, match="float32"):
        Contribution(np.zeros(4), 1)
    with pytest.raises(StrategyError, match="secure_sum is False"):
        get_strategy("fedmr").aggregate_sum(1, SumTotal(np.zeros(4, np.float32), 1, {}, 1), None)
    state = get_strategy("fedavg").init(np.zeros(3, np.float32), Setup(clients=range(2)))
    with pytest.raises(StrategyError, match="total weight 0"):
        get_strategy("fedavg").aggregate_sum(1, SumTotal(np.zeros(3, np.float32), 0, {}, 0), state)
    with pytest.raises(StrategyError, match="4 values, the server's buffers 3"):
        get_strategy("fedavg").aggregate_sum(1, SumTotal(np.zeros(4, np.float32), 1, {}, 1), state)


class Recording(PrivacyHooks):
    def __init__(self):
        self.seen = []

    def client_delta(self, delta, rng):
        self.seen.append(("client", delta.size))
        delta *= 0.5          # in place on the hook's own copy
        return delta

    def server_sum(self, total, round):
        self.seen.append(("server", round, total.count))
        return total.replace(vector=total.vector * 2)

    def round_metrics(self, round):
        return {"epsilon": 0.25 * round}


def test_the_hooks_run_where_the_docstring_says(fed):
    model, clients = fed
    strategy = get_strategy("fedavg")
    setup = Setup(clients=sorted(clients), train={"lr": 0.1, "steps": 2}, seed=1, rounds=1)
    engine = RoundEngine.for_run(strategy, setup, model, 3)
    state = strategy.init(model.init(0), setup)
    plan = engine.open_round(1, state)
    hooks = Recording()
    contribs, plain = {}, {}
    for c, task in plan.tasks.items():
        update, _ = strategy.train(task, clients[c], None)
        contribs[c] = client_contribution(strategy, task, update, hooks,
                                          np.random.default_rng(c))
        plain[c] = client_contribution(strategy, task, update, NO_HOOKS)
        assert np.array_equal(contribs[c].vector, plain[c].vector * np.float32(0.5))
        assert not np.array_equal(task.buffers["params"], update.buffers["params"])
        assert set(contribs[c].scalars) == set(LOSS_SCALARS)
    closed = engine.close_round_clear_sum(plan, contribs, state, hooks=hooks, train_wall_s=0.0)
    ref = engine.close_round_clear_sum(plan, plain, state, train_wall_s=0.0)
    assert [s[0] for s in hooks.seen] == ["client"] * 3 + ["server"]
    assert hooks.seen[-1] == ("server", 1, 3)
    assert closed.record["epsilon"] == 0.25
    assert np.allclose(closed.model, ref.model, atol=1e-6)       # x0.5 then x2
    assert closed.record["uplink_bytes"] == 3 * state.buffers["params"].nbytes


def test_upload_totals_of_a_sum():
    total = SumTotal(np.zeros(2, np.float32), 2, {LOSS_SCALARS[0]: 6.0, LOSS_SCALARS[1]: 4.0}, 2)
    assert UploadTotals.of_sum(total, 16) == UploadTotals(16, 1.5)


class Budget(PrivacyHooks):
    def server_sum(self, total, round):
        if round == 3:
            raise BudgetExhausted("epsilon 2.1 would pass the target 2.0")
        return total


@pytest.mark.parametrize("workers", [1, 2])
def test_a_summing_simulation_matches_the_clear_one_and_a_budget_ends_it(fed, workers):
    model, clients = fed
    setup = Setup(clients=sorted(clients), train={"lr": 0.1, "steps": 3}, seed=2, rounds=4)
    test = (clients[0].x, clients[0].y)
    clear = run_federation(get_strategy("fedavg"), model.init(0), clients, setup, 3,
                           test=test, workers=workers)
    summed = run_federation(get_strategy("fedavg"), model.init(0), clients, setup, 3,
                            test=test, workers=workers, summing=True)
    assert summed.stopped is None and len(summed.history) == 4
    assert np.max(np.abs(clear.params - summed.params)) <= 8 * EPS32 * np.max(np.abs(clear.params))
    stopped = run_federation(get_strategy("fedavg"), model.init(0), clients, setup, 3,
                             test=test, workers=workers, summing=True, hooks=Budget())
    assert stopped.stopped == {"reason": "privacy_budget", "in_round": 3, "rounds_done": 2,
                               "rounds_planned": 4,
                               "message": "round 3: epsilon 2.1 would pass the target 2.0"}
    assert [h["round"] for h in stopped.history] == [1, 2]
    assert all(h["test_accuracy"] is not None for h in stopped.history)
