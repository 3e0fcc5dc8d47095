"""FedVeca (Luo et al., 2021/22; docs/algorithms.md#fedveca): the properties a correct
implementation must have, on real data (scikit-learn's digits) and, where a property needs
a quadratic, a least-squares model whose loss is exactly (h/2)||w - c_i||^2, all through the
real kernels. Section, equation, figure and algorithm numbers are the paper's.

The properties, numbered as the tests below cite them, and where they are checked:
  1 FedAvg equivalence ........ test_equal_tau_without_adaptation_is_fedavg_bit_for_bit,
                                test_rounds_one_and_two_are_fedavg_even_when_adaptive
                                (tau = 1 is impossible here: FedVeca needs tau >= 2 for
                                its estimators' ranges to be non-empty)
  2 FedNova equivalence ....... test_fixed_unequal_steps_are_fednova_bit_for_bit_and_not_fedavg
  3 G identity ................ test_normalised_gradient_identity
  4 weights / global gradient . test_global_gradient_is_the_weighted_client_gradients,
                                test_identical_full_batch_clients_share_the_global_gradient
  5 tau range ................. test_adaptive_run_keeps_tau_integer_in_range
  6 argmin client ............. test_argmin_client_gets_floor_of_one_over_one_minus_alpha
  7 invariances ............... test_rule_is_invariant_to_scale_of_A_and_to_eta,
                                test_tau_does_not_depend_on_L
  8 monotonicity, table ....... test_rule_reproduces_the_threshold_table, test_rule_is_monotone
  9 alpha = 0.5 ............... test_alpha_one_half_gives_two_steps_from_round_three
 10 schedule .................. test_schedule_of_estimates_L_and_first_adaptive_tau
 11 quadratic estimators ...... test_estimators_on_a_quadratic
 12 delta bound, beta max ..... test_estimators_match_a_direct_computation (both bounds)
 13 guards .................... test_degenerate_A_values_give_valid_steps,
                                test_zero_initial_model_skips_L0_and_stays_finite,
                                test_estimators_on_degenerate_statistics
 14 streaming = batch ......... test_estimators_match_a_direct_computation
 15 protocol equivalence ...... test_single_exchange_equals_the_two_exchange_protocol
 16 bytes ..................... test_bytes_per_round
 17 baseline tau .............. test_baseline_steps_worked_example (the rest of property 17,
                                "centralised SGD runs exactly tau_all steps", is a property
                                of kernels.local_train's `steps`, not of this strategy)
 18 partitions ................ test_case_one_and_case_two_partitions (Case 3's mixed
                                partitioner does not exist in edgefl.data; it belongs with
                                the partitioners, not here)
 19 qualitative reproduction .. not a unit test: 10 seeds x 100 rounds x 3 methods x 3 cases
                                is an experiment (tools/ and docs/results.md, issue #3 item 6)
"""
import math

import numpy as np
import pytest

from edgefl import kernels
from edgefl.data import load_dataset, partition
from edgefl.models import build_model
from edgefl.runs.prepare import local_datasets
from edgefl.sim import run_federation
from edgefl.strategies import (LocalData, Setup, StrategyError, Task, Update, exact_weights,
                               get_strategy, strategy_names, strategy_params)
from edgefl.strategies.fedveca import (FedVeca, baseline_steps, estimate_beta_delta,
                                       next_steps, noniid_coefficient)

TRAIN = {"lr": 0.05, "batch_size": 32}


@pytest.fixture(scope="module")
def non_iid(digits, softmax):
    """Case 2 of the paper's §IV-A3 on digits: client j holds digits {j, j+5}."""
    return local_datasets(digits, partition(digits, "mod", 5, 0), softmax)


def run(strategy, clients, init, *, rounds, train=TRAIN, m=None, seed=0, test=None):
    setup = Setup(clients=sorted(clients), train=train, seed=seed, rounds=rounds)
    return run_federation(strategy, init, clients, setup, m or len(clients), workers=2, test=test)


def drive(strategy, clients, w0, rounds, train=TRAIN, seed=0):
    """Run rounds by hand (full participation); per round: (state before, tasks, updates,
    state after, metrics)."""
    state = strategy.init(w0, Setup(clients=sorted(clients), train=train, seed=seed))
    log = []
    for t in range(1, rounds + 1):
        tasks = strategy.configure(t, sorted(clients), state)
        updates = {c: strategy.train(task, clients[c], None)[0] for c, task in tasks.items()}
        new, metrics = strategy.aggregate(t, updates, state)
        log.append((state, tasks, updates, new, metrics))
        state = new
    return log


def replay(data, start, cfg):
    """The reference that stores everything (property 14): every model w^s (s = 0..tau) the
    kernel visits and every minibatch gradient g^s (s = 0..tau-1) at it, recomputed from
    the kernel's own batch order (kernels.shuffle) with kernels.loss_grad."""
    cfg = dict(cfg)
    x, y, n = data.x, data.y, data.num_samples
    bs = n if cfg["batch_size"] <= 0 or cfg["batch_size"] >= n else cfg["batch_size"]
    ws, gs, pos, epoch, perm = [], [], n, 0, None
    for s in range(cfg["steps"] + 1):
        w = np.array(start, copy=True)
        if s:
            kernels.local_train(data.model, w, x, y, dict(cfg, steps=s, grad0_mode=0))
        ws.append(w)
        if s == cfg["steps"]:
            break
        if bs == n:
            idx = np.arange(n)
        else:
            if pos >= n:
                perm, epoch, pos = kernels.shuffle(cfg["seed"], epoch, n), epoch + 1, 0
            idx = perm[pos:pos + bs]
            pos += idx.size
        gs.append(kernels.loss_grad(data.model, w, x[idx], y[idx])[1])
    return ws, gs


def direct_estimates(ws, gs, g0, gn2, lr, variant):
    """beta and delta of Alg. 2 l.15-18 from stored models and gradients, in float64."""
    w0 = ws[0].astype(np.float64)
    g0 = g0.astype(np.float64)
    beta, delta, total = 0.0, 0.0, np.zeros_like(w0)
    for s, g in enumerate(gs):
        total += g
        if s == 0:
            continue
        dist = np.linalg.norm(w0 - ws[s])
        if dist > 1e-12:
            beta = max(beta, np.linalg.norm(g0 - g) / dist)
        term = (total @ total / ((s + 1) * gn2) if variant == "alg2"
                else dist ** 2 / (lr ** 2 * s * gn2))
        delta = max(delta, term)
    return beta, delta


# ---------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------

def test_registered_with_the_documented_defaults():
    assert "fedveca" in strategy_names()
    assert strategy_params("fedveca") == {
        "alpha": 0.95, "tau_init": 10, "tau_min": 2, "tau_max": 50, "tau_floor_tol": 1e-9,
        "delta_variant": "alg2", "grad_at_global": "batch", "adapt": True,
        "alpha_clamp": False, "weighting": "samples"}


@pytest.mark.parametrize("params, message", [
    ({"alpha": 1.0}, r"alpha = 1\.0 must be a number in \(0\.0, 1\.0\)"),
    ({"alpha": 0}, r"alpha = 0 must be a number in \(0\.0, 1\.0\)"),
    ({"tau_init": 1}, r"tau_init = 1 must be an integer in \[2, 50\]"),
    ({"tau_init": 60}, r"tau_init = 60 must be an integer in \[2, 50\]"),
    ({"tau_init": 10.0}, r"tau_init = 10\.0 must be an integer"),
    ({"tau_min": 1}, r"tau_min = 1 must be an integer in \[2, "),
    ({"tau_max": 5}, r"tau_init = 10 must be an integer in \[2, 5\]"),
    ({"tau_floor_tol": -1e-9}, r"tau_floor_tol = -1e-09 must be"),
    ({"delta_variant": "a4"}, r"delta_variant = 'a4'; valid: alg2, theory"),
    ({"grad_at_global": "loss"}, r"grad_at_global = 'loss'; valid: batch, full"),
    ({"adapt": "yes"}, r"adapt = 'yes'; valid: true, false"),
    ({"weighting": "median"}, r"weighting = 'median'; valid: samples, uniform"),
])
def test_bad_parameters_name_the_key_and_the_valid_values(params, message):
    with pytest.raises(StrategyError, match=r"'fedveca': " + message):
        get_strategy("fedveca", **params)


def test_train_settings_that_conflict_with_fedveca_are_rejected(softmax):
    w0 = softmax.init(0)
    with pytest.raises(StrategyError,
                       match=r"train\.steps = 5 conflicts with strategy tau_init = 10"):
        FedVeca().init(w0, Setup(clients=range(2), train={"steps": 5}))
    with pytest.raises(StrategyError, match=r"train\.weight_decay = 0\.01 is not supported"):
        FedVeca().init(w0, Setup(clients=range(2), train={"weight_decay": 0.01}))
    FedVeca(tau_init=5).init(w0, Setup(clients=range(2), train={"steps": 5}))   # agreeing is fine


# ---------------------------------------------------------------------------------------
# reductions: FedAvg and FedNova (properties 1-2)
# ---------------------------------------------------------------------------------------

def test_equal_tau_without_adaptation_is_fedavg_bit_for_bit(digits, softmax, non_iid):
    """Property 1: tau_(k,i) = 5 for all i (adapt off) gives FedAvg's models exactly, with
    |D_i| weights renormalised over 3 of 5 clients per round."""
    test = (digits.x_test, digits.y_test)
    veca = run(FedVeca(adapt=False, tau_init=5), non_iid, softmax.init(0), rounds=6, m=3, test=test)
    avg = run(get_strategy("fedavg"), non_iid, softmax.init(0), rounds=6, m=3, test=test,
              train=dict(TRAIN, steps=5))
    assert np.array_equal(veca.params, avg.params) and veca.model_sha256 == avg.model_sha256
    assert [h["test_accuracy"] for h in veca.history] == [h["test_accuracy"] for h in avg.history]
    assert all(set(h["tau"].values()) == {5} for h in veca.history)
    assert all("beta" in h and "A" in h for h in veca.history[1:])     # the estimates still ran


def test_rounds_one_and_two_are_fedavg_even_when_adaptive(softmax, non_iid):
    """Alg. 1 l.24-26: rounds 1 and 2 run tau_init everywhere, so they are FedAvg's; round 3
    adapts and departs from it."""
    for rounds, same in ((2, True), (3, False)):
        veca = run(FedVeca(tau_init=6), non_iid, softmax.init(0), rounds=rounds)
        avg = run(get_strategy("fedavg"), non_iid, softmax.init(0), rounds=rounds,
                  train=dict(TRAIN, steps=6))
        assert np.array_equal(veca.params, avg.params) is same


def test_fixed_unequal_steps_are_fednova_bit_for_bit_and_not_fedavg(digits, softmax):
    """Property 2 with Fig. 2's tau = (5, 2) on two clients: FedVeca's update (5) is
    FedNova's bit for bit, training is undisturbed by the statistics it records, and the
    result differs from FedAvg's average."""
    clients = local_datasets(digits, partition(digits, "mod", 2, 0), softmax)
    w0 = softmax.init(1)
    setup = Setup(clients=[0, 1], train=TRAIN)
    veca, nova = FedVeca(), get_strategy("fednova")
    tasks = {c: Task(1, {"params": w0}, veca.local_config(setup, 1, c, steps=tau,
                                                          grad0_mode="batch"))
             for c, tau in ((0, 5), (1, 2))}
    updates = {c: veca.train(t, clients[c], None)[0] for c, t in tasks.items()}
    nova_updates = {c: nova.train(t, clients[c], None)[0] for c, t in tasks.items()}
    for c in (0, 1):
        assert np.array_equal(updates[c].buffers["params"], nova_updates[c].buffers["params"])
    assert [updates[c].steps for c in (0, 1)] == [5, 2]
    by_veca, metrics = veca.aggregate(1, updates, veca.init(w0, setup))
    by_nova, _ = nova.aggregate(1, nova_updates, nova.init(w0, setup))
    assert np.array_equal(by_veca.buffers["params"], by_nova.buffers["params"])
    by_avg, _ = get_strategy("fedavg").aggregate(1, nova_updates, nova.init(w0, setup))
    assert not np.allclose(by_avg.buffers["params"], by_veca.buffers["params"],
                           rtol=1e-4, atol=1e-6)
    # and the update is w_k - eta tau_k sum_i p_i G_i, G_i = (w_k - w_i) / (eta tau_i)
    _, p = exact_weights(updates)
    p = [float(q) for q in p]
    eta, taus, wk = TRAIN["lr"], (5, 2), w0.astype(np.float64)
    tau_k = sum(q * t for q, t in zip(p, taus))
    d_k = sum(q * (wk - updates[c].buffers["params"]) / (eta * t)
              for c, q, t in zip((0, 1), p, taus))
    np.testing.assert_allclose(by_veca.buffers["params"], wk - eta * tau_k * d_k,
                               rtol=1e-6, atol=1e-7)
    assert metrics["tau_eff"] == pytest.approx(tau_k)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), 1e30])
def test_a_normaliser_its_steps_do_not_give_is_refused_naming_the_client(softmax, non_iid, bad):
    """(5) divides by ||a_i||_1 and scales by tau_k = sum p_i ||a_i||_1: a board reporting one
    its tau_(k,i) steps do not give crashed the round without naming it (0, nan, inf) or
    moved w_{k+1} arbitrarily (1e30); it is refused, and the others' round is unchanged."""
    veca = FedVeca()
    state = veca.init(softmax.init(1), Setup(clients=sorted(non_iid), train=TRAIN))
    tasks = veca.configure(1, sorted(non_iid), state)
    updates = {c: veca.train(task, non_iid[c], None)[0] for c, task in tasks.items()}
    forged = dict(updates)
    forged[3] = Update(updates[3].buffers, updates[3].num_samples, updates[3].train_loss,
                       updates[3].steps, {**updates[3].scalars, "a_norm": bad})
    with pytest.raises(StrategyError, match=r"client\(s\) \[3\].*'a_norm'"):
        veca.aggregate(1, forged, state)
    rest = {c: u for c, u in updates.items() if c != 3}
    new, _ = veca.aggregate(1, rest, state)
    assert np.all(np.isfinite(new.buffers["params"]))


# ---------------------------------------------------------------------------------------
# the client's quantities (properties 3, 4, 12, 14)
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("grad_at_global", ["batch", "full"])
@pytest.mark.parametrize("variant", ["alg2", "theory"])
def test_estimators_match_a_direct_computation(softmax, non_iid, grad_at_global, variant):
    """Property 14: beta and delta from the kernel's streamed step statistics equal a float64
    computation over every stored model and gradient; property 12: delta is at least its
    lambda = tau-1 term tau ||G||^2 / ||grad F(w_{k-1})||^2 and beta at least every
    beta^lambda; the uploaded gradient is g^0 (batch) or the full local gradient (full)."""
    strategy = FedVeca(tau_init=7, grad_at_global=grad_at_global, delta_variant=variant)
    log = drive(strategy, non_iid, softmax.init(2), 3)
    checked = 0
    for _, tasks, updates, _, _ in log[1:]:                      # rounds with estimates
        for c, task in tasks.items():
            data, w_k, update = non_iid[c], task.buffers["params"], updates[c]
            ws, gs = replay(data, w_k, task.train)
            assert np.array_equal(ws[-1], update.buffers["params"])
            g0 = gs[0] if grad_at_global == "batch" else \
                kernels.loss_grad(softmax, w_k, data.x, data.y)[1]
            np.testing.assert_allclose(update.buffers["grad0"], g0, rtol=1e-5, atol=1e-6)
            gn2, lr, tau = task.scalars["gn2"], task.train["lr"], task.train["steps"]
            beta, delta = direct_estimates(ws, gs, g0, gn2, lr, variant)
            assert update.scalars["beta"] == pytest.approx(beta, rel=1e-5)
            assert update.scalars["delta"] == pytest.approx(delta, rel=1e-5)
            G = (w_k.astype(np.float64) - ws[-1]) / (lr * tau)
            if variant == "alg2":
                assert update.scalars["delta"] >= tau * (G @ G) / gn2 * (1 - 1e-5)
            dist = [np.linalg.norm(w_k.astype(np.float64) - w) for w in ws[1:-1]]
            betas = [np.linalg.norm(g0.astype(np.float64) - g) / d for g, d in zip(gs[1:], dist)]
            assert update.scalars["beta"] >= max(betas) * (1 - 1e-5)
            checked += 1
    assert checked == 2 * 5


def test_normalised_gradient_identity(softmax, non_iid):
    """Property 3: G = (w_k - w^tau) / (eta tau) is the mean of the tau minibatch gradients."""
    strategy = FedVeca(tau_init=9)
    _, tasks, updates, _, _ = drive(strategy, non_iid, softmax.init(3), 1)[0]
    for c, task in tasks.items():
        _, gs = replay(non_iid[c], task.buffers["params"], task.train)
        lr, tau = task.train["lr"], task.train["steps"]
        G = (task.buffers["params"].astype(np.float64) - updates[c].buffers["params"]) / (lr * tau)
        mean = np.mean(np.array(gs, dtype=np.float64), axis=0)
        assert np.linalg.norm(G - mean) <= 1e-4 * np.linalg.norm(mean)


def test_global_gradient_is_the_weighted_client_gradients(softmax, non_iid):
    """Property 4: p_i sum to exactly 1 and grad F(w_k) = sum_i p_i grad F_i(w_k) (eq. (8)),
    whose squared norm is the scalar sent with the next round's tasks."""
    log = drive(FedVeca(), non_iid, softmax.init(0), 2)
    _, _, updates, after, _ = log[0]
    clients, p = exact_weights(updates)
    assert sum(p) == 1
    want = sum(float(q) * updates[c].buffers["grad0"].astype(np.float64)
               for c, q in zip(clients, p))
    np.testing.assert_allclose(after.buffers["grad_prev"], want, rtol=1e-6, atol=1e-7)
    gn2 = float(after.buffers["grad_prev"].astype(np.float64) @ after.buffers["grad_prev"])
    assert log[1][1][0].scalars["gn2"] == pytest.approx(gn2, rel=1e-12)
    assert "gn2" not in log[0][1][0].scalars                     # none in round 1 (k = 0)


def test_identical_full_batch_clients_share_the_global_gradient(digits, softmax):
    """Property 4: with identical client data and full-batch gradients, grad F(w_k) equals
    every client's gradient, which is the kernels' gradient of the local loss."""
    data = {c: LocalData(c, softmax, digits.x_train[:300], digits.y_train[:300]) for c in range(3)}
    w0 = softmax.init(4)
    _, _, updates, after, _ = drive(FedVeca(), data, w0, 1, train={"lr": 0.1, "batch_size": 0})[0]
    _, g = kernels.loss_grad(softmax, w0, data[0].x, data[0].y)
    for c in range(3):
        assert np.array_equal(updates[c].buffers["grad0"], updates[0].buffers["grad0"])
    assert np.array_equal(after.buffers["grad_prev"], updates[0].buffers["grad0"])
    np.testing.assert_allclose(after.buffers["grad_prev"], g, rtol=1e-5, atol=1e-7)


def _quadratic_clients(h, centers):
    """Least squares with X = s I (d samples): F_i(w) = (1/d) sum_j (s w_j - s c_ij)^2 / 2
    = (h/2) ||w - c_i||^2 with h = s^2 / d, exactly the quadratic of property 11."""
    d = centers.shape[1]
    s = math.sqrt(h * d)
    model = build_model({"name": "linear", "bias": False}, (d,), 0)
    x = np.ascontiguousarray(s * np.eye(d, dtype=np.float32))
    return model, {i: LocalData(i, model, x, np.ascontiguousarray((s * c).astype(np.float32)))
                   for i, c in enumerate(centers)}


def test_estimators_on_a_quadratic():
    """Property 11: full-batch gradients of F_i = (h/2)||w - c_i||^2: every beta^lambda = h,
    so beta = h; the per-round global smoothness L_k = h from L_1 on; delta equals the
    closed form max_lambda ||sum_{s<=lambda} h (w^s - c_i)||^2 / ((lambda+1) ||grad F(w_{k-1})||^2)
    over float64 gradient-descent iterates."""
    h, eta = 2.0, 0.05
    centers = np.random.default_rng(0).standard_normal((3, 8))
    model, clients = _quadratic_clients(h, centers)
    log = drive(FedVeca(tau_init=6), clients, np.full(8, 0.5, np.float32), 5,
                train={"lr": eta, "batch_size": 0})
    c_bar = centers.mean(axis=0)
    for k, (before, tasks, updates, _, metrics) in enumerate(log):
        if k == 0:
            assert "beta" not in metrics
            continue
        w_prev = log[k - 1][1][0].buffers["params"].astype(np.float64)       # w_{k-1}
        gn2 = float(np.sum((h * (w_prev - c_bar)) ** 2))
        for i, task in tasks.items():
            assert updates[i].scalars["beta"] == pytest.approx(h, rel=1e-4)
            w = task.buffers["params"].astype(np.float64)
            total, delta = np.zeros(8), 0.0
            for lam in range(task.train["steps"]):
                g = h * (w - centers[i])
                total += g
                if lam >= 1:
                    delta = max(delta, total @ total / ((lam + 1) * gn2))
                w = w - eta * g
            assert updates[i].scalars["delta"] == pytest.approx(delta, rel=1e-4)
        if k >= 2:
            assert metrics["L_round"] == pytest.approx(h, rel=1e-3)


@pytest.mark.parametrize("stats, gn2, beta, delta", [
    (np.zeros((4, 3)), 1.0, 0.0, 0.0),                       # zero gradient, no movement
    (np.array([[0, 0, 1], [1, 2, 4], [3, 2, 9]], float), 0.0, 1.5, 0.0),   # zero global gradient
    (np.array([[0, 0, 1], [1, 2, 4], [3, 2, 9]], float), None, 1.5, None),  # round k = 0
    (np.array([[0, 0, 1], [1, 2, 4], [3, 2, 9]], float), 2.0, 1.5, 1.5),
])
def test_estimators_on_degenerate_statistics(stats, gn2, beta, delta):
    """Property 13 (zero gradient) and the estimators' ranges: s = 0 never counts; delta is None
    without a global gradient and 0 when it is zero."""
    assert estimate_beta_delta(stats, gn2, 0.1) == (beta, delta)
    nan = estimate_beta_delta(np.array([[0, 0, 1], [np.nan, 1, 1]]), 1.0, 0.1)
    assert math.isnan(nan[0]) and next_steps({0: noniid_coefficient(0.1, nan[0], 1.0),
                                              1: 1.0}, 0.95) == {0: 2, 1: 20}


# ---------------------------------------------------------------------------------------
# the step-size rule (properties 5-9, 13)
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("r, tau", [
    (1.0, 20), (1.002, 19), (1.05, 10), (1.1, 7), (1.18, 5), (1.26, 4), (1.42, 3), (1.8, 2),
    (1.9, 2), (2.5, 2), (1e6, 2)])
def test_rule_reproduces_the_threshold_table(r, tau):
    """Rule (15)'s thresholds at interior points (property 8's examples), alpha = 0.95."""
    out = next_steps({0: 0.3, 1: 0.3 * r}, 0.95)
    assert out == {0: 20, 1: tau}


def test_argmin_client_gets_floor_of_one_over_one_minus_alpha():
    """Property 6 with the floor tolerance: 20 at alpha = 0.95 (19 without it), 2 at 0.5,
    the cap 50 at 0.995."""
    A = {0: 0.7, 1: 3.0}
    assert next_steps(A, 0.95)[0] == 20
    assert next_steps(A, 0.95, tau_floor_tol=0.0)[0] == 19
    assert next_steps(A, 0.5)[0] == 2
    assert next_steps(A, 0.995)[0] == 50
    assert next_steps(A, 0.995, tau_max=1000)[0] == 200


def test_rule_is_invariant_to_scale_of_A_and_to_eta():
    """Property 7: tau is unchanged when all A are multiplied by c > 0 and when eta changes
    (A = eta beta^2 delta is proportional to eta)."""
    rng = np.random.default_rng(0)
    beta, delta = rng.uniform(1, 5, 8), rng.uniform(0.5, 3, 8)
    pairs = list(enumerate(zip(beta, delta)))
    base = next_steps({i: noniid_coefficient(0.01, b, d) for i, (b, d) in pairs}, 0.95)
    for eta in (0.001, 0.3, 7.0):
        A = {i: noniid_coefficient(eta, b, d) for i, (b, d) in enumerate(zip(beta, delta))}
        assert next_steps(A, 0.95) == base
    for c in (1e-3, 3.0, 1e5):
        A = {i: 0.01 * c * b * b * d for i, (b, d) in enumerate(zip(beta, delta))}
        assert next_steps(A, 0.95) == base
    assert len(set(base.values())) > 1


def test_rule_is_monotone_and_in_range():
    """Properties 5 and 8: A_i <= A_j implies tau_i >= tau_j; every tau an integer in
    [2, tau_max] and at most floor(1/(1-alpha))."""
    rng = np.random.default_rng(1)
    for alpha in (0.5, 0.9, 0.95, 0.99):
        A = dict(enumerate(rng.lognormal(0, 0.3, 40)))
        out = next_steps(A, alpha)
        order = sorted(A, key=A.get)
        taus = [out[i] for i in order]
        assert taus == sorted(taus, reverse=True)
        assert all(isinstance(t, int) and 2 <= t <= min(50, int(1 / (1 - alpha) + 1e-9))
                   for t in taus)


def test_degenerate_A_values_give_valid_steps():
    """Property 13, our handling of degenerate A: min A = 0 gives the zero-A clients
    floor(1/(1-alpha)) and the rest tau_min; NaN and inf give tau_min; all inf gives tau_min
    everywhere."""
    assert next_steps({0: 0.0, 1: 0.0, 2: 1.0, 3: float("nan"), 4: float("inf")}, 0.95) == \
        {0: 20, 1: 20, 2: 2, 3: 2, 4: 2}
    assert next_steps({0: float("inf"), 1: float("nan")}, 0.95) == {0: 2, 1: 2}
    assert noniid_coefficient(0.1, float("nan"), 1.0) == float("inf")
    assert noniid_coefficient(0.1, 1e200, 1e200) == float("inf")
    with pytest.raises(StrategyError, match=r"alpha = 1\.5 must be in \(0, 1\)"):
        next_steps({0: 1.0}, 1.5)


def test_adaptive_run_keeps_tau_integer_in_range(softmax, non_iid):
    """Property 5 over a run, and the paper's Fig. 6 behaviour: tau varies across rounds."""
    result = run(FedVeca(), non_iid, softmax.init(0), rounds=8)
    taus = [t for h in result.history for t in h["tau"].values()]
    assert all(isinstance(t, int) and 2 <= t <= 20 for t in taus)
    assert all(isinstance(t, int) for t in result.state.meta["tau"].values())
    assert len(set(taus)) > 2
    assert all(np.isfinite(result.params))


def test_alpha_one_half_gives_two_steps_from_round_three(softmax, non_iid):
    """Property 9: alpha = 0.5 makes every tau 2 from the first adaptive round on."""
    result = run(FedVeca(alpha=0.5), non_iid, softmax.init(0), rounds=5)
    assert [set(h["tau"].values()) for h in result.history] == [{10}, {10}, {2}, {2}, {2}]


def test_tau_does_not_depend_on_L(softmax, non_iid):
    """Property 7: L is a diagnostic; the same round with a very different running L gives
    the same tau (alpha_clamp off, the paper's default)."""
    log = drive(FedVeca(), non_iid, softmax.init(0), 2)
    before, _, updates, after, _ = log[1]
    for L in (1e-6, 1e6):
        again, _ = FedVeca().aggregate(2, updates, before.replace(L=L, L_pending=L))
        assert again.meta["tau"] == after.meta["tau"]
    clamped, metrics = FedVeca(alpha_clamp=True).aggregate(2, updates,
                                                           before.replace(L_pending=1e-9))
    assert metrics["alpha_eff"] < 0.95 and clamped.meta["tau"] != after.meta["tau"]


# ---------------------------------------------------------------------------------------
# schedule, protocol, guards, bytes (properties 10, 13, 15, 16)
# ---------------------------------------------------------------------------------------

def test_schedule_of_estimates_L_and_first_adaptive_tau(softmax, non_iid):
    """Property 10: rounds 1 and 2 (k = 0, 1) run tau_init; round 1 sends and uses no beta
    or delta; the first L estimate is logged in round 2; round 3 runs the tau that round 2's
    rule chose."""
    log = drive(FedVeca(tau_init=4), non_iid, softmax.init(0), 3)
    (_, t1, u1, _, m1), (_, t2, u2, _, m2), (_, t3, u3, s3, m3) = log
    assert all(t.train["steps"] == 4 for t in (*t1.values(), *t2.values()))
    assert all("beta" not in u.scalars and "delta" not in u.scalars for u in u1.values())
    assert not {"beta", "delta", "A", "L", "L_round"} & set(m1)
    assert all({"beta", "delta"} <= set(u.scalars) for u in u2.values())
    assert m2["L_round"] is not None and m2["L"] == m2["L_round"]
    assert {c: t.train["steps"] for c, t in t3.items()} == {c: log[1][3].meta["tau"][str(c)]
                                                           for c in t3}
    assert m3["tau"] == {c: t.train["steps"] for c, t in t3.items()}
    assert m3["L"] == max(m2["L_round"], m3["L_round"])


def test_single_exchange_equals_the_two_exchange_protocol(softmax, non_iid):
    """Property 15: the paper's order (the client trains and uploads w^tau and grad F_i(w_k);
    the server then sends the vector grad F(w_{k-1}), and the client computes beta and delta
    from the statistics it kept) gives the same beta, delta, tau and models as shipping
    ||grad F(w_{k-1})||^2 with w_k."""
    strategy = FedVeca(tau_init=5)
    single = drive(strategy, non_iid, softmax.init(5), 4)
    state = strategy.init(softmax.init(5), Setup(clients=sorted(non_iid), train=TRAIN))
    for t, (_, _, s_updates, s_after, _) in enumerate(single, start=1):
        setup = strategy.setup(state)
        updates = {}
        for c in sorted(non_iid):                                 # exchange 1
            cfg = strategy.local_config(setup, t, c, steps=state.meta["tau"][str(c)],
                                        grad0_mode="batch")
            w = np.array(state.buffers["params"], copy=True)
            g0, stats = np.empty_like(w), np.zeros((cfg["steps"], 3))
            result = kernels.local_train(softmax, w, non_iid[c].x, non_iid[c].y, cfg,
                                         grad0=g0, step_stats=stats)
            updates[c] = (w, g0, stats, result)
        uploads = {}
        for c, (w, g0, stats, result) in updates.items():         # exchange 2 (k >= 1)
            scalars = {"a_norm": float(result["steps"])}
            if t > 1:
                vector = state.buffers["grad_prev"]               # grad F(w_{k-1}), sent whole
                scalars["beta"], scalars["delta"] = estimate_beta_delta(
                    stats, kernels.sqnorm(vector), TRAIN["lr"])
            uploads[c] = Update({"params": w, "grad0": g0}, non_iid[c].num_samples,
                                result["mean_loss"], result["steps"], scalars)
            for key in ("beta", "delta"):
                assert uploads[c].scalars.get(key) == s_updates[c].scalars.get(key)
        state, _ = strategy.aggregate(t, uploads, state)
        assert np.array_equal(state.buffers["params"], s_after.buffers["params"])
        assert state.meta["tau"] == s_after.meta["tau"]
    assert len({t for h in single for t in h[4]["tau"].values()}) > 1


def test_zero_initial_model_skips_L0_and_stays_finite(digits):
    """Property 13: a zero-initialised SVM (||w_0|| = 0) skips L_0 instead of making
    L infinite; no exception, no NaN, tau in range."""
    evenodd = load_dataset("digits", binary="even-odd")
    svm = build_model({"name": "svm", "l2": 0.1}, evenodd.input_shape, evenodd.num_classes)
    clients = local_datasets(evenodd, partition(evenodd, "mod", 4, 0), svm)
    result = run(FedVeca(), clients, svm.init(zero=True), rounds=5,
                 train={"lr": 0.01, "batch_size": 50})
    h = result.history
    assert h[1]["L_round"] is None and h[1]["L"] is None and h[1]["eta_tau_L"] is None
    assert all(math.isfinite(x["L"]) for x in h[2:])
    assert np.all(np.isfinite(result.params))
    assert all(2 <= t <= 20 for x in h for t in x["tau"].values())


def test_bytes_per_round(softmax, non_iid):
    """Property 16: uplink 2 d floats (w^tau and grad F_i(w_k)) and downlink d floats per
    client and round; the O(1) scalars are not buffers."""
    d = softmax.n_params
    result = run(FedVeca(), non_iid, softmax.init(0), rounds=3, m=4)
    assert [h["uplink_bytes"] for h in result.history] == [4 * 2 * 4 * d] * 3
    assert [h["downlink_bytes"] for h in result.history] == [4 * 4 * d] * 3
    assert all(h["partial_participation"] for h in result.history)


def test_baseline_steps_worked_example():
    """Property 17 (the baselines' tau of §IV-A1): Case 3 MNIST sizes with tau_all / K = 40
    give [6, 6, 6, 7, 11]."""
    sizes = [10200, 10200, 10200, 11769, 17635]
    assert baseline_steps(40 * 100, 100, sizes) == [6, 6, 6, 7, 11]
    assert baseline_steps(7, 1, [1, 1]) == [3, 3]
    with pytest.raises(StrategyError, match="rounds >= 1"):
        baseline_steps(10, 0, sizes)


def test_case_one_and_case_two_partitions(digits):
    """Property 18 on digits: Case 1 (iid) sizes differ by at most 1; Case 2 with N = 5
    gives client j the digits {j, j+5}."""
    sizes = partition(digits, "iid", 5, 0).sizes
    assert sizes.max() - sizes.min() <= 1 and sizes.sum() == len(digits.y_train)
    split = partition(digits, "mod", 5, 0)
    assert [sorted(set(digits.y_train[i].tolist())) for i in split.indices] == \
        [[j, j + 5] for j in range(5)]


def test_metrics_are_logged_per_client(softmax, non_iid):
    """The issue's log list: per-client tau, beta, delta, A, and L every round from round 2."""
    result = run(FedVeca(), non_iid, softmax.init(0), rounds=3)
    for h in result.history[1:]:
        for key in ("tau", "beta", "delta", "A", "direction"):
            assert sorted(h[key]) == sorted(non_iid)
        assert all(a == pytest.approx(0.05 * h["beta"][c] ** 2 * h["delta"][c])
                   for c, a in h["A"].items())
        assert set(h["direction"].values()) == {1}
        assert {"L", "L_round", "tau_next", "eta_tau_L", "thm2_condition"} <= set(h)


def test_simulate_runs_the_shipped_config(tmp_path):
    """edgefl/configs/fedveca.yaml runs end to end through `edgefl simulate`, and its
    metrics.jsonl carries the per-client tau, beta, delta, A (JSON keys are client ids)."""
    import json

    from edgefl.cli import main

    out = tmp_path / "veca"
    assert main(["simulate", "fedveca", "--out", str(out), "--quiet", "--set", "rounds=4"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [set(r["tau"].values()) for r in rows[:2]] == [{10}, {10}]
    assert sorted(rows[2]["beta"]) == ["0", "1", "2", "3", "4"] and rows[2]["L"] > 0
    assert json.loads((out / "summary.json").read_text())["final_accuracy"] > 0.3
