"""DR-FedAvg (edgefl/strategies/drfedavg.py; docs/algorithms.md#dr-fedavg), the DUW paper's
reweighting baseline (its eq. (12)), on scikit-learn's digits through the real kernels.

Its defining property: each round the server weights client k by
(N_k/N) l_k(w^(t))^(q+1), normalised, where l_k(w^(t)) is the loss of the broadcast model on
k's whole local data -- so the clients the model serves worst pull hardest, and with equal
losses the weights are FedAvg's. The rest is DUW's environment: every client every round,
and a failed upload contributes w^(t) with its full weight.
"""
import numpy as np
import pytest

from edgefl import kernels
from edgefl.sim import run_federation
from edgefl.strategies import (LocalData, Setup, StrategyError, get_strategy,
                               weighted_average)
from edgefl.strategies.drfedavg import dr_weights


def label_skewed(ds, model, label_sets, sizes):
    """Client k holds sizes[k] samples of labels label_sets[k] only (no sample twice)."""
    used, clients = set(), {}
    for k, (labels, n) in enumerate(zip(label_sets, sizes)):
        idx = [i for i in np.flatnonzero(np.isin(ds.y_train, labels)) if i not in used][:n]
        used.update(idx)
        clients[k] = LocalData(k, model, np.ascontiguousarray(ds.x_train[idx]),
                               np.ascontiguousarray(ds.y_train[idx]))
    return clients


def setup_for(clients, rounds):
    return Setup(clients=sorted(clients), train={"lr": 0.05, "batch_size": 20, "epochs": 1},
                 seed=0, rounds=rounds)


def test_weights_are_data_share_times_loss_to_the_q_plus_1():
    n, loss = [100, 300, 600], [2.0, 1.0, 0.5]
    for q in (0.0, 1.0, 2.5):
        terms = np.array(n) / 1000 * np.array(loss) ** (q + 1)
        assert dr_weights(n, loss, q) == pytest.approx(terms / terms.sum(), rel=1e-15)
    # equal losses: FedAvg's N_k / N, whatever q
    assert dr_weights(n, [0.7] * 3, 1.0) == pytest.approx([0.1, 0.3, 0.6], rel=1e-15)
    # a larger q moves weight towards the worst-served client
    assert dr_weights(n, loss, 2.0)[0] > dr_weights(n, loss, 1.0)[0] > dr_weights(n, loss, 0.0)[0]
    with pytest.raises(StrategyError, match="finite"):
        dr_weights(n, [1.0, float("nan"), 1.0], 1.0)


def test_weights_are_the_ratio_of_12_when_the_powers_overflow_or_underflow():
    """(12) is a ratio: scaling every loss by one factor changes no weight. The powers
    l_k^(q+1) of very large or very small losses (a diverging client, a large q) overflow to
    inf or underflow to 0 in float64, which must not turn the weights into NaN or into the
    data shares."""
    n = [100, 300]
    want = np.array([0.25 * 1.0, 0.75 * 4.0]) / 3.25          # losses 1 : 2, q = 1
    for scale in (1e200, 1e-200):
        np.testing.assert_allclose(dr_weights(n, [scale, 2 * scale], 1.0), want, rtol=1e-14)
    big = 2.0 ** 61                                             # losses 1 : 2, q = 60
    for scale in (1e5, 1e-6):
        np.testing.assert_allclose(dr_weights([10, 10], [scale, 2 * scale], 60.0),
                                   [1 / (1 + big), big / (1 + big)], rtol=1e-14)
    # the largest loss on a client without data: the others' terms still underflow
    np.testing.assert_allclose(dr_weights([10, 10, 0], [1e-200, 2e-200, 1.0], 1.0),
                               [0.2, 0.8, 0.0], rtol=1e-14)
    # a client whose loss is 0 gets no weight, however small the others' losses
    assert dr_weights([10, 10], [0.0, 1e-300], 1.0).tolist() == [0.0, 1.0]
    # every term 0 (a client with data but zero loss, one with loss but no data): shares
    assert dr_weights([10, 0], [0.0, 1.0], 1.0).tolist() == [1.0, 0.0]


def test_round_weights_clients_by_their_loss_at_the_broadcast_model(digits, softmax):
    """One round by hand: the aggregate is sum_k Theta_k w_k with Theta from (12), the losses
    being the broadcast model's on each client's data; the client holding labels the model
    does worst on gets more than its data share."""
    clients = label_skewed(digits, softmax, [[0, 1], [2, 3, 4, 5], [6, 7, 8, 9]], [60, 120, 120])
    setup = setup_for(clients, 3)
    w0 = softmax.init(2)
    dr = get_strategy("drfedavg", q=1).prepare(w0, clients, setup)
    state = dr.init(w0, setup)
    tasks = dr.configure(1, [0, 1, 2], state)
    updates = {c: dr.train(tasks[c], clients[c], None)[0] for c in range(3)}
    losses = [kernels.evaluate_samples(clients[c].samples, w0)["loss"] for c in range(3)]
    assert [updates[c].scalars["start_loss"] for c in range(3)] == losses
    new, metrics = dr.aggregate(1, updates, state)
    theta = dr_weights([60, 120, 120], losses, 1.0)
    assert metrics["theta"] == list(theta)
    want = weighted_average([updates[c].buffers["params"] for c in range(3)], theta)
    assert np.array_equal(new.buffers["params"], want)
    # the second round, from a model that has learned: the worst-served client gains weight
    tasks = dr.configure(2, [0, 1, 2], new)
    updates = {c: dr.train(tasks[c], clients[c], None)[0] for c in range(3)}
    _, metrics = dr.aggregate(2, updates, new)
    worst = int(np.argmax([updates[c].scalars["start_loss"] for c in range(3)]))
    shares = np.array([60, 120, 120]) / 300
    assert metrics["theta"][worst] > shares[worst]


def test_equal_losses_make_it_fedavg_in_the_same_environment(digits, softmax):
    """Identical clients have equal losses, so DR-FedAvg's weights are N_k / N: the same run
    as FedAvg in DUW's environment (DUW with M = 0), to float round-off of the weights."""
    one = label_skewed(digits, softmax, [list(range(10))], [80])[0]
    clients = {k: LocalData(k, softmax, one.x, one.y) for k in range(3)}
    setup = setup_for(clients, 3)
    w0 = softmax.init(5)
    dr = get_strategy("drfedavg").prepare(w0, clients, setup)
    fedavg = get_strategy("duw", meta_iterations=0).prepare(w0, clients, setup)
    ours = run_federation(dr, w0, clients, setup, 3, workers=1)
    theirs = run_federation(fedavg, w0, clients, setup, 3, workers=1)
    np.testing.assert_allclose(ours.params, theirs.params, rtol=0, atol=1e-6)


def test_failed_upload_contributes_the_broadcast_model(digits, softmax):
    clients = label_skewed(digits, softmax, [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]], [50, 50, 50])
    setup = setup_for(clients, 2)
    w0 = softmax.init(1)
    dr = get_strategy("drfedavg", upload_prob=[0.0, 1.0, 1.0]).prepare(w0, clients, setup)
    state = dr.init(w0, setup)
    tasks = dr.configure(1, [0, 1, 2], state)
    assert [tasks[c].upload for c in range(3)] == [False, True, True]
    updates = {c: dr.train(tasks[c], clients[c], None)[0] for c in (1, 2)}
    new, metrics = dr.aggregate(1, updates, state)
    losses = [updates[c].scalars["start_loss"] for c in (1, 2)]
    theta = dr_weights([50, 50, 50], [np.mean(losses), *losses], 1.0)
    want = weighted_average([w0, updates[1].buffers["params"], updates[2].buffers["params"]],
                            theta)
    assert np.array_equal(new.buffers["params"], want) and metrics["dropped"] == [0]


@pytest.mark.parametrize("params, key", [({"q": -0.5}, "q"), ({"base": "fednova"}, "base"),
                                         ({"table": [[1.0]]}, "table")])
def test_bad_parameters_name_the_key(params, key):
    with pytest.raises(StrategyError, match=key):
        get_strategy("drfedavg", **params)
