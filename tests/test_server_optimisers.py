"""The server optimisers FedAvgM (Hsu, Qi, Brown 2019) and FedAdam / FedYogi (Reddi et al.,
ICLR 2021, Algorithm 2): their server updates against NumPy implementations of the papers'
equations written here, over several rounds; FedAvgM with beta = 0, eta = 1 against FedAvg
bit for bit; their parameters; and the shipped example configs through the CLI.

The contract every strategy keeps (read-only buffers, threads, loopback, resume, parameter
errors) is tests/test_strategy_contract.py's."""
from __future__ import annotations

import json

import numpy as np
import pytest

from edgefl.cli import main
from edgefl.runconfig import load_run_config
from edgefl.sim import simulate
from edgefl.strategies import Setup, StrategyError, Update, get_strategy

N = 257                      # parameters of the synthetic model


def setup_for(clients):
    return Setup(clients=clients, train={"lr": 0.1}, rounds=5)


def client_models(rng, x, clients, round):
    """{client: Update} whose models scatter around x, with the scale of the updates
    changing from round to round (so the adaptive terms do something) and unequal
    sample counts (so the weighting matters)."""
    scale = [0.05, 0.3, 0.01, 0.2, 0.5][round % 5]
    return {c: Update({"params": (x + scale * rng.standard_normal(N) * (1 + c)).astype(
                np.float32)}, num_samples=10 + 7 * c, train_loss=1.0, steps=3)
            for c in clients}


def average_update(updates, x, weighting):
    """Delta_t = sum_i p_i (x_i - x_t) in float64."""
    clients = sorted(updates)
    if weighting == "uniform":
        p = np.full(len(clients), 1 / len(clients))
    else:
        n = np.array([updates[c].num_samples for c in clients], dtype=np.float64)
        p = n / n.sum()
    return sum(pi * (updates[c].buffers["params"].astype(np.float64) - x)
               for pi, c in zip(p, clients))


# ---------------------------------------------------------------------------------------
# FedAdam, FedYogi: Reddi et al., Algorithm 2
# ---------------------------------------------------------------------------------------

def paper_fedopt(kind, x, deltas, eta, beta1, beta2, tau):
    """Algorithm 2 in float64 from x_0 over the given average updates: (x, m, v) after
    each round. m_{-1} = 0, v_{-1} = tau^2, no bias correction."""
    m, v = np.zeros_like(x), np.full_like(x, tau ** 2)
    out = []
    for delta in deltas:
        m = beta1 * m + (1 - beta1) * delta
        if kind == "fedadam":
            v = beta2 * v + (1 - beta2) * delta ** 2
        else:
            v = v - (1 - beta2) * delta ** 2 * np.sign(v - delta ** 2)
        x = x + eta * m / (np.sqrt(v) + tau)
        out.append((x, m, v))
    return out


@pytest.mark.parametrize("kind", ["fedadam", "fedyogi"])
@pytest.mark.parametrize("params", [
    {},                                                        # the defaults
    {"eta": 0.3, "beta1": 0.5, "beta2": 0.9, "tau": 0.05, "weighting": "samples"},
])
def test_server_update_follows_algorithm_2_over_several_rounds(kind, params):
    """Six rounds of synthetic client models, sampled clients changing from round to round:
    the strategy's model, m and v match the paper's equations in float64 to float32
    precision, round after round (the strategy keeps its state in float32)."""
    rng = np.random.default_rng(7)
    strategy = get_strategy(kind, **params)
    hp = {k: getattr(strategy, k) for k in ("eta", "beta1", "beta2", "tau")}
    x0 = rng.standard_normal(N).astype(np.float32)
    state = strategy.init(x0, setup_for(range(5)))
    x, m, v = x0.astype(np.float64), np.zeros(N), np.full(N, hp["tau"] ** 2)
    for r in range(1, 7):
        clients = sorted(rng.choice(5, size=3, replace=False).tolist())
        updates = client_models(rng, state.buffers["params"], clients, r)
        # the reference starts each round from the strategy's (float32) state, so a
        # mismatch shows in the round where it happens, not as accumulated drift
        x = state.buffers["params"].astype(np.float64)
        m, v = state.buffers["m"].astype(np.float64), state.buffers["v"].astype(np.float64)
        delta = average_update(updates, x, strategy.weighting)
        (want_x, want_m, want_v), = paper_fedopt(kind, x, [delta], **hp) if r == 1 else \
            [_one_step(kind, x, m, v, delta, **hp)]
        state, metrics = strategy.aggregate(r, updates, state)
        np.testing.assert_allclose(state.buffers["m"], want_m, rtol=2e-6, atol=1e-9)
        np.testing.assert_allclose(state.buffers["v"], want_v, rtol=2e-6, atol=1e-12)
        np.testing.assert_allclose(state.buffers["params"], want_x, rtol=2e-6, atol=2e-6)
        assert metrics["train_loss"] == 1.0 and metrics["server_step_norm"] > 0
    # and the whole trajectory from x_0 against the paper's equations run on their own
    # (float64 throughout): the float32 state drifts only at float32 precision
    rng = np.random.default_rng(11)
    state = strategy.init(x0, setup_for(range(4)))
    deltas, x = [], x0.astype(np.float64)
    for r in range(1, 7):
        updates = client_models(rng, state.buffers["params"], [0, 1, 2, 3], r)
        deltas.append(average_update(updates, state.buffers["params"].astype(np.float64),
                                     strategy.weighting))
        state, _ = strategy.aggregate(r, updates, state)
    want_x, want_m, want_v = paper_fedopt(kind, x, deltas, **hp)[-1]
    np.testing.assert_allclose(state.buffers["params"], want_x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state.buffers["v"], want_v, rtol=1e-5)


def _one_step(kind, x, m, v, delta, eta, beta1, beta2, tau):
    m = beta1 * m + (1 - beta1) * delta
    if kind == "fedadam":
        v = beta2 * v + (1 - beta2) * delta ** 2
    else:
        v = v - (1 - beta2) * delta ** 2 * np.sign(v - delta ** 2)
    return x + eta * m / (np.sqrt(v) + tau), m, v


def test_yogi_moves_v_towards_delta_squared_by_a_bounded_step_and_adam_does_not():
    """The property that tells the two apart: after a burst of large updates Adam's v jumps
    to about (1 - beta2) Delta^2 + beta2 v, Yogi's by the same amount; once the updates
    are small again Adam's v decays geometrically (x beta2 each round) while Yogi's falls
    by at most (1 - beta2) Delta^2 per round, so Yogi keeps its larger v (smaller steps)."""
    x0 = np.zeros(N, dtype=np.float32)
    states = {k: get_strategy(k).init(x0, setup_for([0])) for k in ("fedadam", "fedyogi")}
    for r, size in enumerate([10.0, 1e-3, 1e-3, 1e-3], start=1):
        for k, state in states.items():
            x = state.buffers["params"]
            up = {0: Update({"params": (x + size).astype(np.float32)}, 1, 0.0, 1)}
            states[k], _ = get_strategy(k).aggregate(r, up, state)
    adam, yogi = states["fedadam"].buffers["v"], states["fedyogi"].buffers["v"]
    assert np.all(yogi > adam)
    np.testing.assert_allclose(adam, 0.99 ** 3 * 0.01 * 100, rtol=1e-3)   # decayed
    np.testing.assert_allclose(yogi, 0.01 * 100, rtol=1e-3)               # barely moved


# ---------------------------------------------------------------------------------------
# FedAvgM: Hsu, Qi, Brown 2019
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("params", [{}, {"eta": 0.7, "beta": 0.5, "weighting": "uniform"}])
def test_fedavgm_server_update_follows_the_paper_over_several_rounds(params):
    """v = beta v + (w - average), w = w - eta v, from v = 0, against float64 NumPy."""
    rng = np.random.default_rng(3)
    strategy = get_strategy("fedavgm", **params)
    x0 = rng.standard_normal(N).astype(np.float32)
    state = strategy.init(x0, setup_for(range(5)))
    for r in range(1, 7):
        clients = sorted(rng.choice(5, size=3, replace=False).tolist())
        updates = client_models(rng, state.buffers["params"], clients, r)
        w = state.buffers["params"].astype(np.float64)
        v = state.buffers["velocity"].astype(np.float64)
        delta = -average_update(updates, w, strategy.weighting)      # w - average
        want_v = strategy.beta * v + delta
        want_w = w - strategy.eta * want_v
        state, _ = strategy.aggregate(r, updates, state)
        np.testing.assert_allclose(state.buffers["velocity"], want_v, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(state.buffers["params"], want_w, rtol=1e-6, atol=1e-7)
        assert np.any(state.buffers["velocity"] != 0)


@pytest.mark.parametrize("partition", [{"name": "iid", "clients": 6},
                                       {"name": "dirichlet", "clients": 6, "alpha": 0.3}])
@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_fedavgm_without_momentum_and_unit_step_is_fedavg_bit_for_bit(tmp_path, partition,
                                                                      weighting):
    """beta = 0, eta = 1: w - (w - average) is the average; both updates are single
    weighted sums with the zero terms left out, so the model is FedAvg's to the bit,
    every round (the Dirichlet split has unequal sample counts)."""
    base = {"dataset": {"name": "digits", "limit_train": 600}, "partition": partition,
            "model": {"name": "mlp", "hidden": [16]}, "clients_per_round": 4,
            "train": {"lr": 0.1, "batch_size": 32, "epochs": 1}, "rounds": 4, "seed": 3}
    runs = {}
    for name, extra in (("fedavg", {}), ("fedavgm", {"beta": 0.0, "eta": 1.0})):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({**base, "strategy": {"name": name, "weighting": weighting,
                                                          **extra}}))
        runs[name] = simulate(load_run_config(str(path)), tmp_path / name, progress=False)
    assert runs["fedavgm"]["model_sha256"] == runs["fedavg"]["model_sha256"]
    curves = {n: [json.loads(line)["test_accuracy"] for line in
                  (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in runs}
    assert curves["fedavgm"] == curves["fedavg"]


# ---------------------------------------------------------------------------------------
# parameters and the example configs
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, key, value", [
    ("fedavgm", "beta", 1.0), ("fedavgm", "beta", -0.1), ("fedavgm", "eta", 0.0),
    ("fedadam", "beta1", 1.0), ("fedadam", "beta2", 1.0), ("fedadam", "tau", 0.0),
    ("fedyogi", "eta", -1.0), ("fedyogi", "weighting", "median"),
])
def test_out_of_range_parameters_are_refused_naming_them(name, key, value):
    with pytest.raises(StrategyError, match=rf"strategy '{name}': {key} = "):
        get_strategy(name, **{key: value})


def test_defaults_are_the_papers_and_the_chosen_server_rates():
    assert {k: getattr(get_strategy("fedadam"), k) for k in ("eta", "beta1", "beta2", "tau",
                                                              "weighting")} == \
        {"eta": 0.03, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3, "weighting": "uniform"}
    assert get_strategy("fedyogi").hyperparameters() == get_strategy("fedadam").hyperparameters()
    assert get_strategy("fedavgm").hyperparameters() == {"eta": 1.0, "beta": 0.9,
                                                         "weighting": "samples"}


@pytest.mark.parametrize("name", ["fedavgm", "fedadam", "fedyogi"])
def test_the_example_config_runs_from_the_cli_and_learns(tmp_path, capsys, name):
    out = tmp_path / "out"
    assert main(["simulate", name, "--set", "rounds=8", "--quiet", "--workers", "2",
                 "--out", str(out)]) == 0
    assert f"{name}: final accuracy" in capsys.readouterr().out
    curve = [json.loads(line)["test_accuracy"]
             for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(curve) == 8 and all(a is not None for a in curve)
    # ten classes: 0.1 is chance; eight rounds of the 30 take every one past 0.5
    assert curve[-1] > max(0.5, curve[0] + 0.2), curve
