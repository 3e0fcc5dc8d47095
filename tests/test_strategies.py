"""Strategies: the interface's contracts (registry, copy-on-write, selection), the aggregation
math, and the properties that follow from the MFL paper (Liu et al., IEEE TPDS 2020: rules
(6)-(9) of its §4.2, Proposition 1 of §5.2, the curves of §7) and the FedUmf paper (Li, Chen,
Yu, Mathematics 2022: rule (F) of its §3.2 and Algorithm 1), on real data (scikit-learn's
digits) through the real kernels. docs/algorithms.md (#mfl, #fedumf) states the rules.

Bit-identity checks compare with array_equal (== per coordinate, so a -0.0/+0.0 difference
is not a failure) and the sha256 of the buffers."""
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pytest

from edgefl import kernels
from edgefl.data import load_dataset, partition
from edgefl.models import build_model
from edgefl.runs.prepare import local_datasets
from edgefl.sim import run_federation
from edgefl.strategies import (LocalData, Setup, State, Strategy, StrategyError, Update,
                               aggregation_weights, client_seed, get_strategy, local_round,
                               register, select_clients, strategy_names, strategy_params,
                               weighted_average)
from edgefl.strategies.fednova import normalizer
from edgefl.strategies.mfl import MFL

# ---------------------------------------------------------------------------------------
# fixtures: digits, a softmax model, client shards
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def evenodd():
    return load_dataset("digits", binary="even-odd")


def iid_clients(ds, model, n, seed=0):
    return local_datasets(ds, partition(ds, "iid", n, seed), model)


def sliced_clients(ds, model, sizes):
    """Contiguous shards of the given sizes (unequal |D_i|, so |D_i| weights differ from a
    plain mean); the last takes the rest."""
    bounds = np.cumsum([0, *sizes, len(ds.y_train) - sum(sizes)])
    return {i: LocalData(i, model, np.ascontiguousarray(ds.x_train[a:b]),
                         np.ascontiguousarray(ds.y_train[a:b]))
            for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))}


def run(strategy, clients, init, *, rounds, train, m=None, seed=0, workers=1, lr_decay=1.0,
        test=None):
    setup = Setup(clients=sorted(clients), train=train, lr_decay=lr_decay, seed=seed, rounds=rounds)
    return run_federation(strategy, init, clients, setup, m or len(clients), workers=workers,
                          test=test)


def pooled_mgd(model, w0, x, y, lr, gamma, steps):
    """Centralised MGD on pooled data, full batch (the MFL paper's (4)-(5))."""
    w, d = w0.copy(), np.zeros_like(w0)
    kernels.local_train(model, w, x, y, kernels.train_config(lr=lr, momentum=gamma, batch_size=0,
                                                            steps=steps), momentum=d)
    return w, d


# ---------------------------------------------------------------------------------------
# registry and parameters
# ---------------------------------------------------------------------------------------

def test_registry_lists_the_strategies_and_rejects_unknown_names():
    assert {"fedavg", "fednova", "mfl", "fedumf"} <= set(strategy_names())
    with pytest.raises(StrategyError, match=r"unknown strategy 'nosuch'; valid: .*fedavg.*mfl"):
        get_strategy("nosuch")


def test_unknown_parameter_names_the_key_and_the_valid_ones():
    with pytest.raises(StrategyError, match=r"'mfl': unknown parameter 'alpha'; valid: gamma, weighting"):
        get_strategy("mfl", alpha=0.5)
    assert strategy_params("fedumf") == {"alpha": 1.0, "weighting": "uniform"}
    assert strategy_params("fedavg") == {"weighting": "samples"}


@pytest.mark.parametrize("name, params, key", [
    ("mfl", {"gamma": 1.0}, "gamma"),          # MFL needs gamma < 1 (its §3.1.2)
    ("mfl", {"gamma": 5}, "gamma"),            # the MFL paper's typo "gamma = 5" (§7.2.2)
    ("mfl", {"gamma": -0.1}, "gamma"),
    ("mfl", {"gamma": "0.5"}, "gamma"),
    ("fedumf", {"alpha": 1.5}, "alpha"),
    ("fedavg", {"weighting": "median"}, "weighting"),
    ("fednova", {"weighting": None}, "weighting"),
])
def test_bad_parameter_values_raise_naming_the_parameter(name, params, key):
    with pytest.raises(StrategyError, match=rf"'{name}': {key} = "):
        get_strategy(name, **params)


def test_register_rejects_a_second_class_under_a_taken_name():
    with pytest.raises(StrategyError, match="registered twice"):
        @register("fedavg")
        @dataclass(frozen=True)
        class Impostor(Strategy):
            pass


# ---------------------------------------------------------------------------------------
# interface contracts
# ---------------------------------------------------------------------------------------

def test_containers_hand_over_read_only_buffers_and_init_copies(softmax):
    w0 = softmax.init(0)
    strategy = get_strategy("fedavg")
    state = strategy.init(w0, Setup(clients=range(3), train={"lr": 0.1}))
    assert w0.flags.writeable and state.buffers["params"] is not w0
    with pytest.raises(ValueError, match="read-only"):
        state.buffers["params"][0] = 1.0
    task = strategy.configure(1, [0, 2], state)[0]
    with pytest.raises(ValueError, match="read-only"):
        task.buffers["params"] += 1.0
    update = Update({"params": np.zeros(4, np.float32)}, 10, 0.5, 3)
    with pytest.raises(ValueError, match="read-only"):
        update.buffers["params"][:] = 1.0
    with pytest.raises(TypeError):
        state.buffers["momentum"] = w0   # the mapping itself is read-only
    with pytest.raises(StrategyError, match="flat contiguous float32"):
        State({"params": np.zeros(4)})


def test_a_run_leaves_the_callers_initial_model_untouched(digits, softmax):
    w0 = softmax.init(3)
    before = w0.copy()
    run(get_strategy("fedavg"), iid_clients(digits, softmax, 4), w0, rounds=2,
        train={"lr": 0.1, "steps": 3})
    assert np.array_equal(w0, before) and w0.flags.writeable


def test_setup_validates_train_keys_and_forbids_a_fixed_seed():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['lrr'\]"):
        Setup(clients=range(2), train={"lrr": 0.1})
    with pytest.raises(StrategyError, match="seed"):
        Setup(clients=range(2), train={"seed": 3})
    with pytest.raises(StrategyError, match="distinct"):
        Setup(clients=[1, 1])


def test_selection_is_seeded_by_seed_and_round_only():
    a = [select_clients(7, r, range(20), 5) for r in range(1, 30)]
    b = [select_clients(7, r, range(20), 5) for r in range(1, 30)]
    assert a == b
    assert all(len(s) == 5 == len(set(s)) and s == sorted(s) for s in a)
    assert len({tuple(s) for s in a}) > 20                        # rounds differ
    assert select_clients(8, 1, range(20), 5) != a[0] or select_clients(8, 2, range(20), 5) != a[1]
    assert select_clients(7, 1, range(20), 20) == list(range(20))
    with pytest.raises(StrategyError, match="cannot select 21 of 20"):
        select_clients(7, 1, range(20), 21)


def test_client_seeds_differ_per_round_and_client_and_are_stable():
    seeds = {client_seed(0, r, c) for r in range(1, 20) for c in range(20)}
    assert len(seeds) == 19 * 20
    assert client_seed(0, 3, 4) == client_seed(0, 3, 4) != client_seed(1, 3, 4)
    assert all(0 <= s < 2 ** 64 for s in seeds)


# ---------------------------------------------------------------------------------------
# aggregation math
# ---------------------------------------------------------------------------------------

def _updates(rng, counts, d=1000):
    return {c: Update({"params": rng.standard_normal(d).astype(np.float32)}, n, 0.0, 1)
            for c, n in counts.items()}


def test_sample_weighted_average_is_exact_float64_accumulation_rounded_once():
    rng = np.random.default_rng(0)
    counts = {4: 100, 1: 300, 9: 50, 2: 550, 7: 1}    # inserted out of order on purpose
    updates = _updates(rng, counts)
    clients, weights = aggregation_weights(updates, "samples")
    assert clients == [1, 2, 4, 7, 9]
    total = sum(counts.values())
    assert weights.tolist() == [counts[c] / total for c in clients]
    expected = np.zeros(1000)
    for c in clients:
        expected += (counts[c] / total) * updates[c].buffers["params"].astype(np.float64)
    got = weighted_average([updates[c].buffers["params"] for c in clients], weights)
    assert np.array_equal(got, expected.astype(np.float32))


def test_fedavg_weighting_samples_vs_uniform(softmax):
    rng = np.random.default_rng(1)
    counts = {0: 10, 1: 30, 2: 60}
    updates = _updates(rng, counts, softmax.n_params)
    state = get_strategy("fedavg").init(softmax.init(0), Setup(clients=range(3), train={}))
    xs = {c: updates[c].buffers["params"].astype(np.float64) for c in counts}
    by_samples, _ = get_strategy("fedavg").aggregate(1, updates, state)
    uniform, _ = get_strategy("fedavg", weighting="uniform").aggregate(1, updates, state)
    want_samples = (0.1 * xs[0] + 0.3 * xs[1] + 0.6 * xs[2]).astype(np.float32)
    want_uniform = ((1 / 3) * xs[0] + (1 / 3) * xs[1] + (1 / 3) * xs[2]).astype(np.float32)
    np.testing.assert_array_max_ulp(by_samples.buffers["params"], want_samples, maxulp=1)
    np.testing.assert_array_max_ulp(uniform.buffers["params"], want_uniform, maxulp=1)
    assert not np.allclose(by_samples.buffers["params"], uniform.buffers["params"])
    assert by_samples.meta["round"] == 1 and state.meta["round"] == 0   # a new state


def test_aggregation_does_not_depend_on_arrival_order(softmax):
    rng = np.random.default_rng(2)
    updates = _updates(rng, {3: 5, 0: 7, 8: 11}, softmax.n_params)
    for name in ("fedavg", "fednova", "fedumf"):
        strategy = get_strategy(name)
        state = strategy.init(softmax.init(0), Setup(clients=range(9), train={}))
        if name == "fednova":
            updates = {c: Update(u.buffers, u.num_samples, 0.0, 1, {"a_norm": 1.0})
                       for c, u in updates.items()}
        forward, _ = strategy.aggregate(1, dict(sorted(updates.items())), state)
        backward, _ = strategy.aggregate(1, dict(sorted(updates.items(), reverse=True)), state)
        assert np.array_equal(forward.buffers["params"], backward.buffers["params"])


# ---------------------------------------------------------------------------------------
# FedNova (Wang et al. 2020)
# ---------------------------------------------------------------------------------------

def test_fednova_matches_the_normalised_update_with_unequal_steps(softmax):
    rng = np.random.default_rng(3)
    d = softmax.n_params
    w = softmax.init(1)
    taus = {0: 2, 1: 5, 2: 11, 3: 40}
    counts = {0: 100, 1: 250, 2: 50, 3: 600}
    updates = {c: Update({"params": (w + 0.01 * rng.standard_normal(d)).astype(np.float32)},
                         counts[c], 0.0, taus[c], {"a_norm": normalizer(taus[c])}) for c in taus}
    strategy = get_strategy("fednova")
    start = strategy.init(w, Setup(clients=range(4), train={}))
    state, metrics = strategy.aggregate(1, updates, start)
    p = {c: counts[c] / sum(counts.values()) for c in taus}
    tau_eff = sum(p[c] * taus[c] for c in taus)
    w64 = w.astype(np.float64)
    want = w64 - tau_eff * sum(p[c] * (w64 - updates[c].buffers["params"]) / taus[c] for c in taus)
    np.testing.assert_allclose(state.buffers["params"], want, rtol=1e-6, atol=1e-7)
    assert metrics["tau_eff"] == pytest.approx(tau_eff)
    fedavg, _ = get_strategy("fedavg").aggregate(1, updates, start)
    assert not np.allclose(fedavg.buffers["params"], state.buffers["params"], rtol=1e-4, atol=1e-6)


def test_fednova_normalizer_for_local_momentum():
    for rho in (0.0, 0.5, 0.9):
        for tau in (1, 4, 17):
            closed = tau if rho == 0 else (tau - rho * (1 - rho ** tau) / (1 - rho)) / (1 - rho)
            assert normalizer(tau, rho) == pytest.approx(closed, rel=1e-12)
    with pytest.raises(StrategyError, match="0 steps"):
        normalizer(0)


def test_fednova_with_equal_steps_is_fedavg_bit_for_bit(digits, softmax):
    clients = iid_clients(digits, softmax, 6)
    train = {"lr": 0.1, "batch_size": 16, "steps": 5}
    nova = run(get_strategy("fednova"), clients, softmax.init(0), rounds=6, train=train, m=4)
    avg = run(get_strategy("fedavg"), clients, softmax.init(0), rounds=6, train=train, m=4)
    assert np.array_equal(nova.params, avg.params)
    assert nova.model_sha256 == avg.model_sha256


def test_fednova_differs_from_fedavg_when_steps_differ(digits, softmax):
    # epochs over unequal shards: tau_i = ceil(|D_i| / B) differs per client
    clients = sliced_clients(digits, softmax, [60, 200, 500])
    train = {"lr": 0.05, "batch_size": 20, "epochs": 1}
    nova = run(get_strategy("fednova"), clients, softmax.init(0), rounds=3, train=train)
    avg = run(get_strategy("fedavg"), clients, softmax.init(0), rounds=3, train=train)
    assert not np.array_equal(nova.params, avg.params)
    sizes = [c.num_samples for c in clients.values()]
    tau_eff = sum(n * -(-n // 20) for n in sizes) / sum(sizes)       # sum_i p_i ceil(n_i / B)
    assert [h["tau_eff"] for h in nova.history] == [pytest.approx(tau_eff)] * 3


@pytest.mark.parametrize("bad", [0.0, 1e30, "three", None])
def test_robust_fednova_rejects_a_normaliser_its_steps_do_not_give_and_closes_the_round(bad):
    # robust's promise (docs/robust.md): a malformed update is rejected, with its reason in
    # the round's metrics, and the round goes on with the rest
    strategy = get_strategy("fednova", robust={"rule": "median"})
    setup = Setup(clients=range(3), train={"lr": 0.1, "steps": 3})
    start = strategy.init(np.zeros(4, np.float32), setup)
    good = {c: Update({"params": np.full(4, c + 1.0, np.float32)}, 10, 0.1, 3, {"a_norm": 3.0})
            for c in (0, 2)}
    forged = Update({"params": np.full(4, 2.0, np.float32)}, 10, 0.1, 3,
                    {} if bad is None else {"a_norm": bad})
    state, metrics = strategy.aggregate(1, {**good, 1: forged}, start)
    assert metrics["robust_rejected"] == [1] and "a_norm" in metrics["robust_reasons"]["1"]
    alone, _ = strategy.aggregate(1, good, start)
    assert np.array_equal(state.buffers["params"], alone.buffers["params"])


@pytest.mark.parametrize("bad", [0.0, -3.0, float("nan"), float("inf"), 1e30, "three"])
def test_fednova_contribution_refuses_a_normaliser_its_steps_do_not_give(bad):
    # the edge aggregator and the DP aggregator turn each board's update into its
    # contribution on the server; a_norm 0 made the vector inf (a numpy warning, no error)
    # and weighted_a_norm 0, 1e30 scaled tau_eff by 1e29, and none named the board
    from edgefl.strategies import Task
    strategy = get_strategy("fednova")
    setup = Setup(clients=range(2), train={"lr": 0.1, "steps": 3, "momentum": 0.5})
    state = strategy.init(np.zeros(4, np.float32), setup)
    task = strategy.configure(1, [0, 1], state)[0]
    assert isinstance(task, Task)
    good = Update({"params": np.ones(4, np.float32)}, 10, 0.1, 3, {"a_norm": normalizer(3, 0.5)})
    assert strategy.contribution(task, good).scalars["weighted_a_norm"] == 10 * normalizer(3, 0.5)
    forged = Update(good.buffers, 10, 0.1, 3, {"a_norm": bad})
    with pytest.raises(StrategyError, match="'a_norm'"):
        strategy.contribution(task, forged)


def test_fednova_with_equal_steps_and_local_momentum_is_fedavg_bit_for_bit(digits, softmax):
    # equal tau_i and rho give every client the same ||a_i||_1, so c_i = p_i exactly
    clients = local_datasets(digits, partition(digits, "dirichlet", 5, 0, alpha=0.5), softmax)
    train = {"lr": 0.05, "batch_size": 16, "steps": 7, "momentum": 0.9}
    nova = run(get_strategy("fednova"), clients, softmax.init(0), rounds=4, train=train, m=3)
    avg = run(get_strategy("fedavg"), clients, softmax.init(0), rounds=4, train=train, m=3)
    assert np.array_equal(nova.params, avg.params)
    assert [h["tau_eff"] for h in nova.history] == [pytest.approx(normalizer(7, 0.9))] * 4


def test_fednova_removes_the_objective_inconsistency_fedavg_has():
    """The paper's §3-4 on quadratics F_i(w) = (w - c_i)^2 / 2 (a bias-only linear model on
    x = 0), equal weights, c = (0, 1), tau = (1, 10) local GD steps at eta = 0.01 (one epoch
    of batches of 10 over 10 and 100 identical samples): FedAvg settles at
    sum p_i (1 - q^tau_i) c_i / sum p_i (1 - q^tau_i), q = 1 - eta, near 0.905, pulled to
    the client that ran longer; FedNova at the same with (1 - q^tau_i) / tau_i, within
    0.012 of the global optimum 0.5 (exact as eta -> 0)."""
    model = build_model({"name": "linear"}, (1,), 0)

    def data(i, n, c):
        return LocalData(i, model, np.zeros((n, 1), np.float32), np.full(n, c, np.float32))

    clients = {0: data(0, 10, 0.0), 1: data(1, 100, 1.0)}
    setup = Setup(clients=[0, 1], train={"lr": 0.01, "batch_size": 10, "epochs": 1}, rounds=400)
    q, taus, c = 0.99, (1, 10), (0.0, 1.0)

    def fixed_point(a):
        return sum(ai * ci for ai, ci in zip(a, c)) / sum(a)

    got = {name: run_federation(get_strategy(name, weighting="uniform"),
                                np.zeros(model.n_params, np.float32), clients, setup, 2)
           for name in ("fedavg", "fednova")}
    bias = {name: float(r.params[-1]) for name, r in got.items()}
    assert bias["fedavg"] == pytest.approx(fixed_point([1 - q ** t for t in taus]), abs=1e-4)
    assert bias["fednova"] == pytest.approx(fixed_point([(1 - q ** t) / t for t in taus]),
                                            abs=1e-4)
    assert abs(bias["fednova"] - 0.5) < 0.012 < 0.4 < abs(bias["fedavg"] - 0.5)
    assert got["fednova"].history[-1]["tau_eff"] == pytest.approx(5.5)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("bad", [0.0, -3.0, float("nan"), float("inf"), 1e30, "three", None])
def test_fednova_refuses_a_normaliser_its_steps_do_not_give_and_keeps_the_rest(momentum, bad):
    # ||a_i||_1 is a function of the client's steps and the task's momentum (the paper's
    # a_i); one that disagrees (a buggy or hostile board) crashed the round with a
    # ZeroDivisionError / OverflowError / ValueError naming no client, froze the model (a
    # negative one made tau_eff 0) or blew it up (1e30 moved it by 1e28)
    from edgefl.rounds import RoundEngine
    w = np.zeros(6, np.float32)
    setup = Setup(clients=range(3), train={"lr": 0.1, "steps": 3, "momentum": momentum})
    strategy = get_strategy("fednova")
    start = strategy.init(w, setup)

    def upd(value, a_norm):
        return Update({"params": np.full(6, value, np.float32)}, 10, 0.1, 3,
                      {} if a_norm is None else {"a_norm": a_norm})

    good = {0: upd(1.0, normalizer(3, momentum)), 2: upd(3.0, normalizer(3, momentum))}
    updates = {**good, 1: upd(2.0, bad)}
    with pytest.raises(StrategyError, match=r"client\(s\) \[1\].*'a_norm'"):
        strategy.aggregate(1, updates, start)
    # the engine of the MQTT aggregator refuses that board alone and closes the round
    refused = {}
    engine = RoundEngine(strategy, setup, 3, 1)
    state, _ = engine.aggregate(1, dict(updates), start, on_unusable=refused.__setitem__)
    assert sorted(refused) == [1] and "a_norm" in str(refused[1])
    want, _ = strategy.aggregate(1, good, start)
    assert np.array_equal(state.buffers["params"], want.buffers["params"])
    assert np.array_equal(start.buffers["params"], w)          # the state it started from


@pytest.mark.parametrize("name, params", [("fednova", {}), ("duw", {"table": [[0.5, 0.25, 0.25]]}),
                                          ("drfedavg", {})])
def test_an_update_without_params_is_refused_naming_the_client_not_a_key_error(name, params):
    # a board's frame may carry any buffer names of the model's size; these three read
    # buffers["params"] unchecked, so a KeyError failed the round instead of the
    # aggregator refusing that board, as it does for every other strategy
    setup = Setup(clients=range(3), train={"lr": 0.1, "steps": 2}, rounds=1)
    strategy = get_strategy(name, **params)
    start = strategy.init(np.zeros(4, np.float32), setup)
    scalars = {"a_norm": 2.0, "start_loss": 1.0}
    updates = {c: Update({"params": np.full(4, c + 1.0, np.float32)}, 10, 0.1, 2, scalars)
               for c in (0, 2)}
    updates[1] = Update({"weights": np.ones(4, np.float32)}, 10, 0.1, 2, scalars)
    _refused_alone(strategy, setup, 1, updates, start, r"client\(s\) \[1\].*'params'")


@pytest.mark.parametrize("name, key", [("fedveca", "beta"), ("fedveca", "delta"),
                                       ("drfedavg", "start_loss")])
@pytest.mark.parametrize("bad", ["0.5", [0.5], None, True])
def test_a_scalar_that_is_not_a_number_is_refused_naming_the_client(name, key, bad):
    # an update's strategy scalars arrive as any JSON value; float() of a string or a list
    # raised ValueError / TypeError, which the aggregator's refusal of an unusable board
    # (it catches StrategyError) did not cover, so one board failed the round
    setup = Setup(clients=range(3), train={"lr": 0.1}, rounds=2)
    strategy = get_strategy(name)
    start = strategy.init(np.zeros(4, np.float32), setup)
    if name == "fedveca":
        start = start.replace(gn2=1.0)          # round k >= 1: beta and delta are due
    steps = 10 if name == "fedveca" else 2

    def upd(c, value):
        scalars = {"a_norm": float(steps), "beta": 1.0 + c, "delta": 1.0, "start_loss": 1.0 + c}
        scalars[key] = value
        buffers = {"params": np.full(4, c + 1.0, np.float32), "grad0": np.ones(4, np.float32)}
        return Update(buffers, 10, 0.1, steps, scalars)

    updates = {0: upd(0, 1.0), 1: upd(1, bad), 2: upd(2, 3.0)}
    _refused_alone(strategy, setup, 2, updates, start, rf"client\(s\) \[1\].*'{key}'")


def _refused_alone(strategy, setup, round, updates, start, match):
    """Client 1's update is a StrategyError (`match`) to the strategy, and the round
    engine refuses it alone: the round aggregates the others to a finite model."""
    from edgefl.rounds import RoundEngine
    with pytest.raises(StrategyError, match=match):
        strategy.aggregate(round, updates, start)
    refused = {}
    engine = RoundEngine(strategy, setup, 3, round)
    state, _ = engine.aggregate(round, dict(updates), start, on_unusable=refused.__setitem__)
    assert sorted(refused) == [1]
    assert np.all(np.isfinite(state.buffers["params"]))


# ---------------------------------------------------------------------------------------
# MFL (Liu et al., IEEE TPDS 2020)
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [4, 2])
def test_mfl_gamma_zero_is_fedavg_bit_for_bit(digits, softmax, m):
    """gamma = 0 is FL bit for bit, with minibatches, |D_i| weights and (m=2) renormalised
    partial participation."""
    clients = iid_clients(digits, softmax, 4)
    train = {"lr": 0.1, "batch_size": 32, "steps": 4}
    test = (digits.x_test, digits.y_test)
    mfl = run(get_strategy("mfl", gamma=0.0), clients, softmax.init(0), rounds=8, train=train, m=m,
              test=test)
    avg = run(get_strategy("fedavg"), clients, softmax.init(0), rounds=8, train=train, m=m, test=test)
    assert np.array_equal(mfl.params, avg.params)
    assert mfl.model_sha256 == avg.model_sha256
    assert [h["test_accuracy"] for h in mfl.history] == [h["test_accuracy"] for h in avg.history]


def test_mfl_single_node_is_centralised_mgd_exactly(digits, softmax):
    """MFL = centralised MGD: with N = 1 (weight 1.0) the match is exact for any tau."""
    clients = {0: LocalData(0, softmax, digits.x_train, digits.y_train)}
    w0 = softmax.init(0)
    result = run(get_strategy("mfl", gamma=0.5), clients, w0, rounds=5,
                 train={"lr": 0.05, "batch_size": 0, "steps": 3})
    w, d = pooled_mgd(softmax, w0, digits.x_train, digits.y_train, 0.05, 0.5, 15)
    assert np.array_equal(result.params, w)
    assert np.array_equal(result.state.buffers["momentum"], d)


@dataclass(frozen=True)
class ResetMomentumMFL(MFL):
    """A wrong variant that must fail the tau = 1 check: momentum reset each round instead of
    averaged by (8)."""

    def aggregate(self, round, updates, state):
        state, metrics = super().aggregate(round, updates, state)
        return state.replace({"momentum": np.zeros_like(state.buffers["momentum"])}), metrics


def test_mfl_tau_one_is_centralised_mgd_and_a_reset_variant_is_not(digits, softmax):
    """tau = 1 is centralised MGD (Proposition 1: h(1) = h(0) = 0, no gap), with unequal
    shards and |D_i| weights, and the reset variant's negative check."""
    clients = sliced_clients(digits, softmax, [200, 300, 400])
    w0 = softmax.init(0)
    train = {"lr": 0.05, "batch_size": 0, "steps": 1}
    mfl = run(get_strategy("mfl", gamma=0.5), clients, w0, rounds=30, train=train)
    w, d = pooled_mgd(softmax, w0, digits.x_train, digits.y_train, 0.05, 0.5, 30)
    np.testing.assert_allclose(mfl.params, w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(mfl.state.buffers["momentum"], d, rtol=1e-4, atol=1e-5)
    reset = run(ResetMomentumMFL(gamma=0.5), clients, w0, rounds=30, train=train)
    assert np.abs(reset.params - w).max() > 100 * np.abs(mfl.params - w).max()
    assert not np.allclose(reset.params, w, rtol=1e-4, atol=1e-5)


def test_mfl_with_identical_data_on_every_node_is_centralised_mgd(digits, softmax):
    """delta = 0 (the same data on every node) gives no gap for any tau: Proposition 1's bound
    h(x) is proportional to delta."""
    clients = {i: LocalData(i, softmax, digits.x_train, digits.y_train) for i in range(3)}
    w0 = softmax.init(2)
    mfl = run(get_strategy("mfl", gamma=0.9), clients, w0, rounds=6,
              train={"lr": 0.02, "batch_size": 0, "steps": 5})
    w, _ = pooled_mgd(softmax, w0, digits.x_train, digits.y_train, 0.02, 0.9, 30)
    np.testing.assert_allclose(mfl.params, w, rtol=1e-6, atol=1e-7)


def test_mfl_first_local_step_is_a_gradient_step(digits, softmax):
    """The first step is GD: with d(0) = 0, (6)-(7) give d(1) = grad F_i(w0) and
    w(1) = w0 - eta grad F_i(w0)."""
    strategy = get_strategy("mfl", gamma=0.7)
    w0 = softmax.init(4)
    state = strategy.init(w0, Setup(clients=[0], train={"lr": 0.05, "batch_size": 0, "steps": 1}))
    data = LocalData(0, softmax, digits.x_train[:300], digits.y_train[:300])
    update, _ = strategy.train(strategy.configure(1, [0], state)[0], data, None)
    _, grad = kernels.loss_grad(softmax, w0, data.x, data.y)
    np.testing.assert_allclose(update.buffers["momentum"], grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(update.buffers["params"], w0 - np.float32(0.05) * grad, rtol=1e-6,
                               atol=1e-7)


def test_mfl_averages_and_broadcasts_momentum_with_sample_weights(digits, softmax):
    """Rule (8): after a round every node's d is sum_i p_i d_i with |D_i| weights."""
    clients = sliced_clients(digits, softmax, [150, 300, 450])
    strategy = get_strategy("mfl", gamma=0.5)
    state = strategy.init(softmax.init(0), Setup(clients=range(4), train={"lr": 0.05, "steps": 3}))
    tasks = strategy.configure(1, range(4), state)
    updates = {c: strategy.train(tasks[c], clients[c], None)[0] for c in range(4)}
    new, _ = strategy.aggregate(1, updates, state)
    sizes = np.array([clients[c].num_samples for c in range(4)], dtype=np.float64)
    p = sizes / sizes.sum()
    want = sum(p[c] * updates[c].buffers["momentum"].astype(np.float64) for c in range(4))
    assert np.array_equal(new.buffers["momentum"], want.astype(np.float32))
    plain_mean = sum(updates[c].buffers["momentum"].astype(np.float64) for c in range(4)) / 4
    assert not np.allclose(new.buffers["momentum"], plain_mean, rtol=1e-3, atol=1e-6)
    broadcast = strategy.configure(2, [1, 3], new)
    assert all(t.buffers["momentum"] is new.buffers["momentum"] for t in broadcast.values())
    assert all(t.train["momentum"] == 0.5 for t in broadcast.values())


def test_mfl_heavy_ball_identity_inside_an_interval(digits, softmax):
    """The heavy-ball form of (6)-(7): w(t) - w(t-1) = gamma (w(t-1) - w(t-2))
    - eta grad F_i(w(t-1))."""
    gamma, lr = 0.8, 0.05
    data = LocalData(0, softmax, digits.x_train[:400], digits.y_train[:400])
    w0 = softmax.init(5)
    d0 = (0.1 * np.random.default_rng(0).standard_normal(w0.size)).astype(np.float32)
    ws = []
    for steps in (1, 2, 3):
        cfg = kernels.train_config(lr=lr, momentum=gamma, batch_size=0, steps=steps)
        w, _, _ = local_round(data, w0, cfg, momentum=d0)
        ws.append(w.astype(np.float64))
    _, g2 = kernels.loss_grad(softmax, ws[1].astype(np.float32), data.x, data.y)
    np.testing.assert_allclose(ws[2] - ws[1], gamma * (ws[1] - ws[0]) - lr * g2, rtol=1e-4, atol=1e-7)


@pytest.fixture(scope="module")
def svm_task(evenodd):
    """The MFL paper's convex setting (§7.1) scaled to digits: even/odd squared-hinge SVM,
    lambda = 0.3, w(0) = 0, full batch, eta = 0.002, N = 4."""
    svm = build_model({"name": "svm", "l2": 0.3}, evenodd.input_shape, evenodd.num_classes)
    return svm, iid_clients(evenodd, svm, 4), svm.init(zero=True)


def _svm_losses(evenodd, svm, clients, w0, gamma, iterations, tau=4):
    """Global training loss F(w(k tau)) after every aggregation."""
    result = run(get_strategy("mfl", gamma=gamma), clients, w0, rounds=iterations // tau,
                 train={"lr": 0.002, "batch_size": 0, "steps": tau},
                 test=(evenodd.x_train, evenodd.y_train))
    return np.array([h["test_loss"] for h in result.history])


def test_mfl_loss_ordering_and_monotone_gamma_on_the_svm(evenodd, svm_task):
    """Fig. 5 and Fig. 7(c) of the MFL paper (T = 1000, tau = 4, i.i.d.): the final global
    training loss
    decreases strictly over gamma in {0, 0.1, 0.3, 0.5, 0.7, 0.9}, every gamma > 0 is below
    FL (gamma = 0), and centralised MGD <= MFL(0.5) (up to fp tolerance)."""
    svm, clients, w0 = svm_task
    losses = [_svm_losses(evenodd, svm, clients, w0, g, 1000)[-1]
              for g in (0.0, 0.1, 0.3, 0.5, 0.7, 0.9)]
    assert all(a > b for a, b in zip(losses, losses[1:])), losses
    w, _ = pooled_mgd(svm, w0, evenodd.x_train, evenodd.y_train, 0.002, 0.5, 1000)
    mgd = kernels.evaluate(svm, w, evenodd.x_train, evenodd.y_train)["loss"]
    assert mgd <= losses[3] * (1 + 1e-4) and losses[3] < losses[0]


def test_mfl_speed_up_and_equal_communication_comparison(evenodd, svm_task):
    """MFL(gamma = 0.5) reaches FL's loss at T = 1000 in ~500 iterations (accept [450, 600]:
    a speed-up of about 1/(1 - gamma) when eta beta is small, as in Fig. 5); at equal
    communication (Fig. 9, §7.2.5: MFL 125 rounds vs FL 250, tau = 4) gamma = 0.6 beats FL
    and gamma = 0.3 does not."""
    svm, clients, w0 = svm_task
    fl = _svm_losses(evenodd, svm, clients, w0, 0.0, 1000)
    half = _svm_losses(evenodd, svm, clients, w0, 0.5, 1000)
    iterations = 4 * (int(np.argmax(half <= fl[-1])) + 1)
    assert (half <= fl[-1]).any() and 450 <= iterations <= 600, iterations
    assert _svm_losses(evenodd, svm, clients, w0, 0.6, 500)[-1] < fl[-1]
    assert _svm_losses(evenodd, svm, clients, w0, 0.3, 500)[-1] > fl[-1]


def test_mfl_non_iid_and_tau_effects(evenodd, svm_task):
    """Fig. 6 and Fig. 8 of the MFL paper (Case 3 needs a mixed partitioner we do not have):
    Case 1 (i.i.d.) <
    Case 2 (node = digit mod N); with Case 2 the final loss grows with tau at T = 1000, with
    i.i.d. data it barely moves, and tau = 1 is centralised MGD."""
    svm, iid, w0 = svm_task
    case2 = local_datasets(evenodd, partition(evenodd, "mod", 4, 0), svm)
    taus = (1, 4, 10, 50)
    non_iid = [_svm_losses(evenodd, svm, case2, w0, 0.5, 1000, tau)[-1] for tau in taus]
    flat = [_svm_losses(evenodd, svm, iid, w0, 0.5, 1000, tau)[-1] for tau in taus]
    assert flat[1] < non_iid[1]
    assert all(a < b for a, b in zip(non_iid, non_iid[1:])), non_iid
    assert max(flat) - min(flat) < 0.05 * (max(non_iid) - min(non_iid))
    w, _ = pooled_mgd(svm, w0, evenodd.x_train, evenodd.y_train, 0.002, 0.5, 1000)
    mgd = kernels.evaluate(svm, w, evenodd.x_train, evenodd.y_train)["loss"]
    assert non_iid[0] == pytest.approx(mgd, rel=1e-4) and flat[0] == pytest.approx(mgd, rel=1e-4)


def test_mfl_rejects_train_momentum(softmax):
    with pytest.raises(StrategyError, match="train.momentum = 0.5 conflicts"):
        get_strategy("mfl").init(softmax.init(0), Setup(clients=[0], train={"momentum": 0.5}))


def test_mfl_labels_partial_participation_as_an_extension(digits, softmax):
    result = run(get_strategy("mfl"), iid_clients(digits, softmax, 4), softmax.init(0), rounds=2,
                 train={"lr": 0.05, "steps": 2}, m=3)
    assert all(h.get("partial_participation") is True for h in result.history)
    full = run(get_strategy("mfl"), iid_clients(digits, softmax, 4), softmax.init(0), rounds=1,
               train={"lr": 0.05, "steps": 2})
    assert "partial_participation" not in full.history[0]


# ---------------------------------------------------------------------------------------
# FedUmf (Li, Chen, Yu, Mathematics 2022)
# ---------------------------------------------------------------------------------------

UMF_TRAIN = {"lr": 0.1, "batch_size": 16, "epochs": 1}


def test_fedumf_alpha_zero_is_uniform_fedavg_bit_for_bit(digits, softmax):
    """alpha = 0 is FedAvg with uniform weights bit for bit, with unauthorised training going
    on (M = 2 of 6)."""
    clients = iid_clients(digits, softmax, 6)
    umf = run(get_strategy("fedumf", alpha=0.0), clients, softmax.init(0), rounds=8, train=UMF_TRAIN, m=2)
    avg = run(get_strategy("fedavg", weighting="uniform"), clients, softmax.init(0), rounds=8,
              train=UMF_TRAIN, m=2)
    assert np.array_equal(umf.params, avg.params) and umf.model_sha256 == avg.model_sha256
    assert [h["trained"] for h in umf.history] == [6] * 7 + [2]     # last round: only S_T
    assert any(h["fused"] for h in umf.history)                      # the rule fired, adding 0


def test_fedumf_with_every_client_selected_is_fedavg_for_any_alpha(digits, softmax):
    """M = N means S_t^c is empty and fusion never fires: FedAvg for any alpha."""
    clients = iid_clients(digits, softmax, 5)
    umf = run(get_strategy("fedumf", alpha=1.0), clients, softmax.init(0), rounds=6, train=UMF_TRAIN)
    avg = run(get_strategy("fedavg", weighting="uniform"), clients, softmax.init(0), rounds=6,
              train=UMF_TRAIN)
    assert np.array_equal(umf.params, avg.params)
    assert all(h["fused"] == [] for h in umf.history)


def test_fedumf_round_one_is_fedavg_round_one(digits, softmax):
    """g_0 = 0 (Algorithm 1), so theta_2 is FedAvg's for any alpha; once a client fuses
    (round 3 here: seed 0 happens to select the same 3 of 8 in rounds 1 and 2) the models differ."""
    clients = iid_clients(digits, softmax, 8)
    for rounds, same in ((1, True), (3, False)):
        umf = run(get_strategy("fedumf", alpha=1.0), clients, softmax.init(0), rounds=rounds,
                  train=UMF_TRAIN, m=3)
        avg = run(get_strategy("fedavg", weighting="uniform"), clients, softmax.init(0),
                  rounds=rounds, train=UMF_TRAIN, m=3)
        assert np.array_equal(umf.params, avg.params) is same
        assert any(h["fused"] for h in umf.history) is not same


def test_fedumf_fused_set_is_selected_minus_previously_selected(digits, softmax):
    """Rule (F) fires for F_t == S_t minus S_{t-1} (t >= 2), and mean |F_t| / M -> 1 - M/N."""
    clients = iid_clients(digits, softmax, 10)
    result = run(get_strategy("fedumf"), clients, softmax.init(0), rounds=60,
                 train={"lr": 0.05, "batch_size": 16, "steps": 1}, m=5)
    history = result.history
    assert history[0]["fused"] == []
    for prev, cur in zip(history, history[1:]):
        assert cur["fused"] == sorted(set(cur["selected"]) - set(prev["selected"]))
    share = np.mean([len(h["fused"]) / 5 for h in history[1:]])
    assert abs(share - (1 - 5 / 10)) < 0.1, share


def _fedumf_rounds(strategy, clients, w0, schedule, train, lr_decay=1.0):
    """Drive the strategy by hand with a fixed authorisation schedule [S_1, S_2, ...];
    returns per round (start global, tasks, updates, client states after)."""
    setup = Setup(clients=sorted(clients), train=train, lr_decay=lr_decay, rounds=0)
    state = strategy.init(w0, setup)
    cstates = {c: None for c in clients}
    log = []
    for t, selected in enumerate(schedule, start=1):
        theta = state.buffers["params"]
        tasks = strategy.configure(t, selected, state)
        assert sorted(tasks) == sorted(clients)            # every client trains (§3.2)
        updates = {}
        for c, task in tasks.items():
            updates[c], cstates[c] = strategy.train(task, clients[c], cstates[c])
        state, metrics = strategy.aggregate(t, {c: updates[c] for c in selected}, state)
        log.append((theta, tasks, updates, dict(cstates), metrics))
    return log


@pytest.mark.parametrize("lr_decay", [1.0, 0.9])
def test_fedumf_stored_updates_and_fused_start_points(digits, softmax, lr_decay):
    """The stored update (g == theta_{t+1} - theta_{t,0}; unauthorised start == theta_t; fused start ==
    theta_t + alpha (eta_t / eta_{t-1}) g_{t-1}, here exactly, as the kernels' axpy is
    fp32 product-then-sum) and the lr ratio of rule (F) (with eta_t = eta_1 0.9^{t-1} the
    fused term is alpha 0.9 g)."""
    clients = iid_clients(digits, softmax, 3)
    alpha = 0.7
    log = _fedumf_rounds(get_strategy("fedumf", alpha=alpha), clients, softmax.init(0),
                         [[0], [1, 2], [0, 1]], UMF_TRAIN, lr_decay)
    for t, (theta, tasks, updates, cstates, metrics) in enumerate(log, start=1):
        for c, task in tasks.items():
            start = theta.copy()
            if c in metrics["fused"]:
                prev = log[t - 2][3][c]
                ratio = task.train["lr"] / prev.meta["lr"]
                assert ratio == pytest.approx(lr_decay)
                start = start + np.float32(alpha * ratio) * prev.buffers["g"]
            params, _, _ = local_round(clients[c], start, task.train)
            assert np.array_equal(cstates[c].buffers["g"], params - start)
            if task.upload:
                assert np.array_equal(updates[c].buffers["params"], params)
            else:
                assert updates[c].buffers == {} and updates[c].nbytes == 0
    assert log[1][4]["fused"] == [1, 2] and log[2][4]["fused"] == [0]


def test_fedumf_closed_form_for_one_full_batch_step(digits, softmax):
    """Closed form of one round for K = 1, plain SGD, full batch, alpha = 1, constant eta, in
    the three cases of Algorithm 1 (authorised and fusing, authorised without fusing,
    unauthorised)."""
    clients = sliced_clients(digits, softmax, [300, 300])
    eta = 0.1
    log = _fedumf_rounds(get_strategy("fedumf", alpha=1.0), clients, softmax.init(0),
                         [[0], [1]], {"lr": eta, "batch_size": 0, "steps": 1})

    def grad(c, w):
        return kernels.loss_grad(softmax, np.ascontiguousarray(w, np.float32),
                                 clients[c].x, clients[c].y)[1].astype(np.float64)

    theta1, theta2 = log[0][0].astype(np.float64), log[1][0].astype(np.float64)
    fused_start = theta2 - eta * grad(1, theta1)
    want_fused = fused_start - eta * grad(1, fused_start)                 # i in S_t minus S_{t-1}
    np.testing.assert_allclose(log[1][2][1].buffers["params"], want_fused, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(log[0][2][0].buffers["params"], theta1 - eta * grad(0, theta1),
                               rtol=1e-5, atol=1e-6)                       # plain step
    np.testing.assert_allclose(log[1][3][0].buffers["g"], -eta * grad(0, theta2),
                               rtol=1e-5, atol=1e-6)                       # unauthorised: stored


def test_fedumf_staleness_is_at_most_one_round(digits, softmax):
    """Staleness <= 1: after two unauthorised rounds only the latest g is fused; a client that
    missed round t-1 fuses nothing."""
    clients = iid_clients(digits, softmax, 3)
    log = _fedumf_rounds(get_strategy("fedumf"), clients, softmax.init(0),
                         [[0], [0], [2]], UMF_TRAIN)
    theta3, tasks3, updates3, _, metrics3 = log[2]
    g2 = log[1][3][2]
    assert g2.meta["round"] == 2 and metrics3["fused"] == [2]
    params, _, _ = local_round(clients[2], theta3 + g2.buffers["g"], tasks3[2].train)
    assert np.array_equal(updates3[2].buffers["params"], params)
    missed = State({"g": g2.buffers["g"]}, {"round": 1, "authorized": False, "lr": 0.1})
    assert not get_strategy("fedumf").fuses(tasks3[2], missed)


def test_fedumf_uplink_equals_fedavg_and_unauthorised_clients_send_nothing(digits, softmax):
    """Uplink bytes per round == M * 4d for FedUmf and FedAvg alike; downlink reaches all N."""
    clients = iid_clients(digits, softmax, 8)
    d = softmax.n_params
    umf = run(get_strategy("fedumf"), clients, softmax.init(0), rounds=3, train=UMF_TRAIN, m=2)
    avg = run(get_strategy("fedavg"), clients, softmax.init(0), rounds=3, train=UMF_TRAIN, m=2)
    assert [h["uplink_bytes"] for h in umf.history] == [h["uplink_bytes"] for h in avg.history] \
        == [2 * 4 * d] * 3
    assert [h["downlink_bytes"] for h in umf.history] == [8 * 4 * d] * 2 + [2 * 4 * d]


def test_fedumf_server_state_does_not_grow_with_clients(digits, softmax):
    """The server keeps no per-client state: its buffers are theta only, whatever N."""
    sizes = []
    for n in (4, 12):
        result = run(get_strategy("fedumf"), iid_clients(digits, softmax, n), softmax.init(0),
                     rounds=2, train=UMF_TRAIN, m=2)
        assert list(result.state.buffers) == ["params"]
        sizes.append(sum(b.nbytes for b in result.state.buffers.values()))
    assert sizes[0] == sizes[1] == 4 * softmax.n_params


def test_fedumf_selection_does_not_depend_on_alpha_and_runs_repeat(digits, softmax):
    """Determinism: equal seeds give equal models, and alpha does not change the selection
    (the selection stream is separate from the training streams)."""
    clients = iid_clients(digits, softmax, 6)
    runs = [run(get_strategy("fedumf", alpha=a), clients, softmax.init(0), rounds=5,
                train=UMF_TRAIN, m=2) for a in (1.0, 1.0, 0.3)]
    assert runs[0].model_sha256 == runs[1].model_sha256 != runs[2].model_sha256
    assert [h["selected"] for h in runs[0].history] == [h["selected"] for h in runs[2].history]


def test_fedumf_fusion_speeds_up_training_at_low_participation(digits):
    """The paper's claim (Tables 1-2: fusion reaches the target accuracy in fewer rounds),
    loose and scaled to digits: at C = 0.1 (2 of 20 clients) the seed-median final
    test accuracy with alpha = 1 beats alpha = 0 (FedAvg)."""
    mlp = build_model({"name": "mlp", "hidden": [64]}, digits.input_shape, digits.num_classes)
    train = {"lr": 0.05, "batch_size": 50, "epochs": 1, "momentum": 0.5, "weight_decay": 5e-4}
    accuracy = {}
    for alpha in (0.0, 1.0):
        finals = []
        for seed in (0, 1, 2):
            clients = iid_clients(digits, mlp, 20, seed)
            result = run(get_strategy("fedumf", alpha=alpha), clients, mlp.init(seed), rounds=40,
                         train=train, m=2, seed=seed, workers=2)
            finals.append(kernels.evaluate(mlp, result.params, digits.x_test, digits.y_test)["accuracy"])
        accuracy[alpha] = float(np.median(finals))
    assert accuracy[1.0] > accuracy[0.0], accuracy


def test_fraction_weights_are_exact_rationals():
    updates = {c: Update({}, n, 0.0, 1) for c, n in {0: 1, 1: 2}.items()}
    _, w = aggregation_weights(updates, "samples")
    assert w.tolist() == [float(Fraction(1, 3)), float(Fraction(2, 3))]
    with pytest.raises(StrategyError, match="weighting 'mean'; valid: samples, uniform"):
        aggregation_weights(updates, "mean")
    with pytest.raises(StrategyError, match="no updates"):
        aggregation_weights({}, "samples")
    # a negative count with a positive total would extrapolate past the other updates
    for counts in ({0: 5, 1: -1}, {0: 0, 1: 0}):
        bad = {c: Update({}, n, 0.0, 1) for c, n in counts.items()}
        with pytest.raises(StrategyError, match=r"sample counts \[.*\] cannot weight"):
            aggregation_weights(bad, "samples")
