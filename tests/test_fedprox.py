"""FedProx (edgefl/strategies/fedprox.py): mu = 0 is FedAvg bit for bit on a real run, mu > 0
changes the model, the proximal term keeps local models nearer the global one the larger mu
is, the tasks carry mu to the kernel (also over MQTT), and bad parameters are named. The
kernel's term itself is tested in tests/test_net.py and tests/c."""
import math

import numpy as np
import pytest

from edgefl.data import load_dataset, partition
from edgefl.models import build_model
from edgefl.runconfig import run_config_from_mapping
from edgefl.runs.prepare import local_datasets
from edgefl.sim import simulate
from edgefl.strategies import Setup, StrategyError, get_strategy, strategy_names, strategy_params

TRAIN = {"lr": 0.1, "batch_size": 32, "epochs": 2}


def run_config(strategy: dict, partition_section: dict, rounds: int = 4):
    return run_config_from_mapping({
        "dataset": {"name": "digits", "limit_train": 600},
        "partition": partition_section,
        "model": {"name": "mlp", "hidden": [16]},
        "strategy": strategy,
        "train": TRAIN,
        "rounds": rounds,
        "clients_per_round": 3,
        "seed": 0,
    })


IID = {"name": "iid", "clients": 6}
NON_IID = {"name": "dirichlet", "clients": 6, "alpha": 0.3}


def sha(config, **kw) -> str:
    return simulate(config, None, workers=2, progress=False, **kw)["model_sha256"]


# ---------------------------------------------------------------------------------------
# FedAvg as the special case, and the proximal term's effect
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("split", [IID, NON_IID], ids=["iid", "dirichlet"])
@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_mu_zero_is_fedavg_bit_for_bit_and_mu_above_zero_is_not(split, weighting):
    fedavg = sha(run_config({"name": "fedavg", "weighting": weighting}, split))
    assert sha(run_config({"name": "fedprox", "mu": 0, "weighting": weighting}, split)) == fedavg
    assert sha(run_config({"name": "fedprox", "mu": 0.0, "weighting": weighting}, split)) == fedavg
    prox = sha(run_config({"name": "fedprox", "mu": 0.1, "weighting": weighting}, split))
    assert prox != fedavg
    assert sha(run_config({"name": "fedprox", "mu": 0.1, "weighting": weighting}, split)) == prox


def test_robust_mu_zero_is_robust_fedavg_bit_for_bit():
    robust = {"rule": "median"}
    fedavg = sha(run_config({"name": "fedavg", "robust": robust}, NON_IID))
    assert sha(run_config({"name": "fedprox", "mu": 0, "robust": robust}, NON_IID)) == fedavg


@pytest.fixture(scope="module")
def non_iid_clients():
    digits = load_dataset("digits")
    model = build_model({"name": "mlp", "hidden": [32]}, digits.input_shape, digits.num_classes)
    clients = local_datasets(digits, partition(digits, "dirichlet", 8, 0, alpha=0.3), model)
    return model, clients


def local_distances(mu, model, clients, w0):
    """||w_k - w_global|| of every client's local model after one round from w0."""
    strategy = get_strategy("fedprox", mu=mu)
    setup = Setup(clients=sorted(clients), train={"lr": 0.1, "batch_size": 16, "epochs": 5},
                  seed=0, rounds=1)
    state = strategy.init(w0, setup)
    tasks = strategy.configure(1, sorted(clients), state)
    dist = []
    for c in sorted(clients):
        assert tasks[c].train["prox_mu"] == mu
        update, _ = strategy.train(tasks[c], clients[c], None)
        dist.append(float(np.linalg.norm(update.buffers["params"].astype(np.float64) - w0)))
    return np.array(dist)


def test_local_models_stay_closer_to_the_global_one_as_mu_grows(non_iid_clients):
    """On a Dirichlet(0.3) split, 5 local epochs: every client's drift from the global model
    shrinks as mu grows (measured: mean 2.38 at mu = 0, 2.33, 1.99, 0.98 at mu = 1), and the
    spread between clients with it (standard deviation 0.35 -> 0.07)."""
    model, clients = non_iid_clients
    w0 = model.init(0)
    w0.flags.writeable = False
    dists = {mu: local_distances(mu, model, clients, w0) for mu in (0.0, 0.01, 0.1, 1.0)}
    for lo, hi in ((0.0, 0.01), (0.01, 0.1), (0.1, 1.0)):
        assert np.all(dists[hi] < dists[lo]), (lo, hi, dists[lo], dists[hi])
    assert dists[1.0].mean() < 0.5 * dists[0.0].mean()
    assert dists[1.0].std() < 0.5 * dists[0.0].std()
    # mu = 0: the same local models as FedAvg's
    fedavg = get_strategy("fedavg")
    setup = Setup(clients=sorted(clients), train={"lr": 0.1, "batch_size": 16, "epochs": 5},
                  seed=0, rounds=1)
    tasks = fedavg.configure(1, sorted(clients), fedavg.init(w0, setup))
    for c, d in zip(sorted(clients), dists[0.0]):
        local = fedavg.train(tasks[c], clients[c], None)[0].buffers["params"]
        assert float(np.linalg.norm(local.astype(np.float64) - w0)) == d


def test_the_client_copies_nothing_but_the_model_and_uploads_only_it(non_iid_clients):
    model, clients = non_iid_clients
    strategy = get_strategy("fedprox", mu=0.5)
    w0 = model.init(1)
    setup = Setup(clients=sorted(clients), train=TRAIN, seed=0, rounds=1)
    state = strategy.init(w0, setup)
    task = strategy.configure(1, [3], state)[3]
    before = task.buffers["params"].copy()
    update, client_state = strategy.train(task, clients[3], None)
    assert set(update.buffers) == {"params"} and client_state is None
    assert task.buffers["params"].tobytes() == before.tobytes()   # the anchor, read only
    assert update.buffers["params"] is not task.buffers["params"]


def test_same_final_model_over_mqtt_as_in_process():
    """prox_mu travels in the announcement's train section: a client over a broker trains
    exactly what the in-process client trains."""
    config = run_config({"name": "fedprox", "mu": 0.3}, NON_IID, rounds=2)
    assert sha(config, transport="mqtt") == sha(config)


# ---------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------

def test_registered_with_fedavgs_parameters_and_mu():
    assert "fedprox" in strategy_names()
    assert strategy_params("fedprox") == {"weighting": "samples", "mu": 0.01}
    assert get_strategy("fedprox").hyperparameters() == {"weighting": "samples", "mu": 0.01}


@pytest.mark.parametrize("params, key", [
    ({"mu": -0.1}, "mu"),
    ({"mu": math.nan}, "mu"),
    ({"mu": math.inf}, "mu"),
    ({"mu": "0.1"}, "mu"),
    ({"mu": True}, "mu"),
    ({"weighting": "median"}, "weighting"),
    ({"robust": {"rule": "mode"}}, "robust.rule"),
])
def test_bad_parameters_are_named(params, key):
    with pytest.raises(StrategyError, match=rf"strategy 'fedprox': {key} = "):
        get_strategy("fedprox", **params)


def test_a_train_prox_mu_beside_the_strategys_mu_is_refused():
    setup = Setup(clients=[0, 1], train={"lr": 0.1, "prox_mu": 0.5})
    with pytest.raises(StrategyError, match="fedprox: train.prox_mu = 0.5 conflicts"):
        get_strategy("fedprox", mu=0.1).init(np.zeros(4, np.float32), setup)


def test_every_update_rejected_names_fedprox():
    """The robust branch reports under this strategy's name, not FedAvg's."""
    from edgefl.strategies import Update
    strategy = get_strategy("fedprox", robust={"rule": "median"})
    state = strategy.init(np.zeros(4, np.float32), Setup(clients=[0, 1], train=TRAIN))
    bad = np.full(4, np.nan, np.float32)
    updates = {c: Update({"params": bad}, 10, 0.5, 1) for c in (0, 1)}
    with pytest.raises(StrategyError, match="^fedprox: round 1: every update was rejected"):
        strategy.aggregate(1, updates, state)
