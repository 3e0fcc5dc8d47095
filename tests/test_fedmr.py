"""FedMR (Hu et al., arXiv; KDD 2024; docs/algorithms.md#fedmr): the properties a correct
implementation must have, on real data (scikit-learn's digits) through the real kernels,
plus the strategy's contracts. Section, algorithm and lemma numbers are the arXiv paper's.

The properties, numbered as the tests below cite them, and where they are checked:
  1 per-unit permutation ...... test_recombination_is_a_per_unit_permutation_of_the_uploads
  2 no intra-unit mixing ...... (same test: every unit slice is one source's slice, in place)
  3 sum / distance invariance . test_sum_and_distance_invariance
  4 global model .............. test_global_model_is_the_mean_of_the_uploads_whatever_the_seed
  5 uniformity ................ test_permutations_are_uniform
  6 independence across units . test_units_are_permuted_independently
  7 K = 1 ..................... test_one_model_is_sequential_training
  8 fixed point ............... test_identical_models_are_a_fixed_point
  9 stage 1 == FedAvg ......... test_stage_one_is_uniform_fedavg_bit_for_bit
 10 switch timing ............. test_switch_timing
 11 zero learning rate ........ test_zero_learning_rate_keeps_every_unit_multiset
 12 segments .................. test_segments_follow_ceil_s_n_x, test_seg_x_one_is_indep
 13 communication ............. test_bytes_equal_fedavg_and_downlinks_are_per_client
 14 momentum hygiene .......... test_momentum_is_fresh_every_round_and_never_uploaded
 15 determinism, replay ....... test_same_seed_same_run_and_logged_permutations_replay
 16 secure recombination ...... not implemented (needs client-to-client channels and
                                encryption; see the module docstring), so not tested
 17 cost ...................... a benchmark, not a timed test (timings flake on a loaded
                                machine):
                                recombination is K x n_units slice copies, O(K P)
 18 smoke reproduction ........ ResNet-20 / CIFAR-10 / 500 rounds is an experiment for
                                tools/ and docs/results.md (issue #3 item 6), not a unit test
"""
import json
import math
from collections import Counter
from fractions import Fraction
from itertools import permutations

import numpy as np
import pytest

from edgefl import kernels
from edgefl.data import partition
from edgefl.models import build_model
from edgefl.runs.prepare import local_datasets
from edgefl.sim import run_federation
from edgefl.strategies import (Setup, StrategyError, get_strategy, local_round,
                               select_clients, strategy_names, strategy_params)
from edgefl.strategies.fedmr import (FedMR, draw_permutations, recombination_units, recombine,
                                     segment_ids)

TRAIN = {"lr": 0.1, "batch_size": 32, "steps": 4}


@pytest.fixture(scope="module")
def mlp(digits):
    return build_model({"name": "mlp", "hidden": [16, 12]}, digits.input_shape, digits.num_classes)


@pytest.fixture(scope="module")
def clients(digits, mlp):
    return local_datasets(digits, partition(digits, "dirichlet", 8, 0, alpha=0.5), mlp)


def run(strategy, clients, init, *, rounds, m, train=TRAIN, seed=0, test=None):
    setup = Setup(clients=sorted(clients), train=train, seed=seed, rounds=rounds)
    return run_federation(strategy, init, clients, setup, m, workers=2, test=test)


def drive(strategy, clients, model, w0, rounds, m, train=TRAIN, seed=0, state=None):
    """Rounds by hand with the simulator's selection; per round: (state before, tasks,
    updates, state after, metrics)."""
    setup = Setup(clients=sorted(clients), train=train, seed=seed, units=Setup.units_of(model))
    state = state or strategy.init(w0, setup)
    log = []
    for t in range(1, rounds + 1):
        tasks = strategy.configure(t, select_clients(seed, t, setup.clients, m), state)
        updates = {c: strategy.train(task, clients[c], None)[0] for c, task in tasks.items()}
        new, metrics = strategy.aggregate(t, updates, state)
        log.append((state, tasks, updates, new, metrics))
        state = new
    return log


def unit_bytes(buf, unit):
    return b"".join(buf[o:o + n].tobytes() for o, n in unit)


# ---------------------------------------------------------------------------------------
# parameters and units
# ---------------------------------------------------------------------------------------

def test_registered_with_the_documented_defaults():
    assert "fedmr" in strategy_names()
    assert strategy_params("fedmr") == {"stage1_rounds": 0, "granularity": "tensor",
                                        "seg_x": 0.0, "weighting": "uniform",
                                        "evaluate_models": False}


@pytest.mark.parametrize("params, message", [
    ({"stage1_rounds": -1}, r"stage1_rounds = -1 must be an integer >= 0"),
    ({"stage1_rounds": 2.5}, r"stage1_rounds = 2\.5 must be an integer >= 0"),
    ({"granularity": "block"}, r"granularity = 'block'; valid: tensor, layer"),
    ({"seg_x": 1.5}, r"seg_x = 1\.5 must be a number in \[0\.0, 1\.0\]"),
    ({"weighting": "median"}, r"weighting = 'median'; valid: samples, uniform"),
])
def test_bad_parameters_name_the_key_and_the_valid_values(params, message):
    with pytest.raises(StrategyError, match=r"'fedmr': " + message):
        get_strategy("fedmr", **params)


def test_units_by_granularity_and_layout_checks(mlp):
    """Units: tensor = every table entry on its own (the authors' code), layer = weight
    and bias together (the paper's wording); units must tile the buffer."""
    units = Setup.units_of(mlp)
    tensor = recombination_units(units, "tensor", mlp.n_params)
    layer = recombination_units(units, "layer", mlp.n_params)
    assert [u[0] for u in tensor] == [(e.offset, e.size) for e in mlp.table.entries]
    assert len(tensor) == 6 and len(layer) == 3 and all(len(u) == 2 for u in layer)
    with pytest.raises(StrategyError, match=r"Setup\.units is empty"):
        FedMR().init(mlp.init(0), Setup(clients=range(2)))
    with pytest.raises(StrategyError, match=r"cover 10 parameters but the model has 12"):
        recombination_units(((((0, 4), (4, 6)),)), "tensor", 12)
    with pytest.raises(StrategyError, match=r"do not tile"):
        recombination_units((((0, 4),), ((5, 7),)), "layer", 12)


# ---------------------------------------------------------------------------------------
# ModelRecombine (properties 1-6, 8, 12)
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("granularity", ["tensor", "layer"])
def test_recombination_is_a_per_unit_permutation_of_the_uploads(clients, mlp, granularity):
    """Properties 1-2 on a real stage-2 round: for every unit, the K new slices are bitwise
    the K uploaded slices (a bijection, nothing reused, nothing mixed), each taken from the
    same position; and the logged permutation says which."""
    log = drive(FedMR(granularity=granularity), clients, mlp, mlp.init(0), 2, m=5)
    _, tasks, updates, after, metrics = log[1]
    uploads = [updates[c].buffers["params"] for c in sorted(updates)]
    new = FedMR.models(after)
    units = recombination_units(Setup.units_of(mlp), granularity, mlp.n_params)
    assert new.shape == (5, mlp.n_params) and len(metrics["permutations"]) == len(units)
    moved = 0
    for unit, perm in zip(units, metrics["permutations"]):
        old = [unit_bytes(u, unit) for u in uploads]
        assert len(set(old)) == 5                                  # distinct uploads
        got = [unit_bytes(row, unit) for row in new]
        assert Counter(got) == Counter(old)                        # multiset, bitwise
        assert [old.index(g) for g in got] == perm                 # the bijection logged
        moved += perm != list(range(5))
    assert moved > 0
    covered = np.zeros(mlp.n_params, bool)
    for unit in units:
        for o, n in unit:
            covered[o:o + n] = True
    assert covered.all()


def test_sum_and_distance_invariance(clients, mlp):
    """Property 3 (Lemma 4.4): column sums in sorted order are equal exactly, in slot order
    within 1e-6; sum_k ||new_k - x||^2 == sum_k ||old_k - x||^2 within 1e-6."""
    _, _, updates, after, _ = drive(FedMR(), clients, mlp, mlp.init(1), 1, m=6)[0]
    old = np.stack([updates[c].buffers["params"] for c in sorted(updates)]).astype(np.float64)
    new = FedMR.models(after).astype(np.float64)
    assert np.array_equal(np.sort(new, axis=0).sum(axis=0), np.sort(old, axis=0).sum(axis=0))
    np.testing.assert_allclose(new.sum(axis=0), old.sum(axis=0), rtol=1e-6, atol=1e-12)
    x = np.random.default_rng(0).standard_normal(mlp.n_params)
    assert ((new - x) ** 2).sum() == pytest.approx(((old - x) ** 2).sum(), rel=1e-6)
    assert not np.array_equal(new, old)


def test_global_model_is_the_mean_of_the_uploads_whatever_the_seed(clients, mlp):
    """Property 4 and Algorithm 1 line 11: w_glb = (1/K) sum of the uploads (uniform, float64
    accumulation, one rounding) equals the mean of the recombined list to rounding, and
    does not depend on the recombination seed."""
    before, _, updates, after, _ = drive(FedMR(), clients, mlp, mlp.init(2), 1, m=5)[0]
    old = np.stack([updates[c].buffers["params"] for c in sorted(updates)]).astype(np.float64)
    sum_ = np.zeros(mlp.n_params)
    for row in old:
        sum_ += 0.2 * row
    assert np.array_equal(after.buffers["params"], sum_.astype(np.float32))
    np.testing.assert_allclose(FedMR.models(after).mean(axis=0, dtype=np.float64),
                               after.buffers["params"], rtol=1e-6, atol=1e-7)
    reseeded = before.replace(setup=dict(before.meta["setup"], seed=99))
    other, _ = FedMR().aggregate(1, updates, reseeded)
    assert np.array_equal(other.buffers["params"], after.buffers["params"])
    assert not np.array_equal(other.buffers["models"], after.buffers["models"])


def test_permutations_are_uniform():
    """Property 5: K = 3, 60k draws; each of the 6 permutations at 1/6 +- 0.01, and the
    chi-square statistic (5 dof) below its 0.1% critical value 20.5."""
    perms = draw_permutations(7, 1, 60000, 3)
    counts = Counter(map(tuple, perms.tolist()))
    assert set(counts) == set(permutations(range(3)))
    freq = np.array([counts[p] for p in permutations(range(3))]) / 60000
    assert np.all(np.abs(freq - 1 / 6) < 0.01)
    assert ((freq * 60000 - 10000) ** 2 / 10000).sum() < 20.5


def test_units_are_permuted_independently():
    """Property 6: K = 10, P(pi_u(k) = pi_v(k)) for neighbouring units is about 1/K, not 1;
    with seg_x = 1 (one segment) it is exactly 1."""
    perms = draw_permutations(3, 5, 4001, 10)
    same = np.mean(perms[1:] == perms[:-1])
    assert abs(same - 0.1) < 0.01
    one = draw_permutations(3, 5, 50, 10, seg_x=1.0)
    assert np.all(one == one[0])


def test_identical_models_are_a_fixed_point(mlp):
    """Property 8: identical models are a fixed point of the recombination."""
    w = mlp.init(4)
    units = recombination_units(Setup.units_of(mlp), "tensor", mlp.n_params)
    out = recombine([w] * 4, units, draw_permutations(0, 1, len(units), 4))
    assert all(np.array_equal(row, w) for row in out)


def test_segments_follow_ceil_s_n_x():
    """Property 12 (FedMR-p x of §5.4): segment s starts at unit ceil(s n x) in exact
    arithmetic; the number of distinct permutations per round is the number of segments,
    ceil(1/x) when n x >= 1."""
    assert segment_ids(10, 0.3) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert segment_ids(10, 0.1) == list(range(10))
    assert segment_ids(6, 0.5) == [0, 0, 0, 1, 1, 1]
    assert segment_ids(4, 0.0) == [0, 1, 2, 3]
    assert segment_ids(4, 1.0) == [0, 0, 0, 0]
    assert segment_ids(7, 0.2) == [0, 0, 1, 2, 2, 3, 4]          # starts 0, 2, 3, 5, 6
    # ceil(1/x) segments, except that the last one can be empty: n = 30, x = 0.07 has
    # starts 0, 3, 5, ..., 21, 24, 26, 28 and ceil(14 * 2.1) = 30 = n, so 14, not 15
    # (in float64, 30 * 0.07 * 10 > 21 would also move the start 21 to 22)
    for n, x, count in ((10, 0.3, 4), (20, 0.25, 4), (12, 0.4, 3), (30, 0.07, 14)):
        ids = segment_ids(n, x)
        perms = draw_permutations(1, 2, n, 10, seg_x=x)
        assert len({tuple(p) for p in perms.tolist()}) == ids[-1] + 1 == count
        assert count == math.ceil(1 / x) or x == 0.07
        assert 21 in {j for j in range(1, n) if ids[j] != ids[j - 1]} or n != 30
        for j in range(1, n):
            starts = {math.ceil(s * n * Fraction(str(x))) for s in range(n)}
            assert (ids[j] != ids[j - 1]) == (j in starts)
            assert np.array_equal(perms[j], perms[j - 1]) == (ids[j] == ids[j - 1])


def test_seg_x_one_is_indep(clients, mlp):
    """Property 12: with seg_x = 1 every recombined model is one whole uploaded model."""
    _, _, updates, after, _ = drive(FedMR(seg_x=1.0), clients, mlp, mlp.init(0), 1, m=5)[0]
    uploads = [updates[c].buffers["params"].tobytes() for c in sorted(updates)]
    assert Counter(row.tobytes() for row in FedMR.models(after)) == Counter(uploads)


def test_recombine_rejects_non_permutations(mlp):
    units = recombination_units(Setup.units_of(mlp), "layer", mlp.n_params)
    w = [mlp.init(i) for i in range(3)]
    with pytest.raises(StrategyError, match="one permutation of 3 per unit"):
        recombine(w, units, np.array([[0, 0, 1], [0, 1, 2], [2, 1, 0]]))


# ---------------------------------------------------------------------------------------
# the two stages and the runs (properties 7, 9, 10, 11, 13, 14, 15)
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_stage_one_is_uniform_fedavg_bit_for_bit(digits, clients, mlp, weighting):
    """Property 9: for rounds r <= stage1_rounds FedMR is FedAvg with uniform weights, round
    by round (same selection, same data order); and, as an option, with |D_i| weights."""
    test = (digits.x_test, digits.y_test)
    mr = run(FedMR(stage1_rounds=5, weighting=weighting), clients, mlp.init(0), rounds=5, m=4,
             test=test)
    avg = run(get_strategy("fedavg", weighting=weighting), clients, mlp.init(0), rounds=5, m=4,
              test=test)
    assert np.array_equal(mr.params, avg.params) and mr.model_sha256 == avg.model_sha256
    assert [h["test_accuracy"] for h in mr.history] == [h["test_accuracy"] for h in avg.history]
    assert [h["stage"] for h in mr.history] == [1] * 5 and "models" not in mr.state.buffers
    # stage 2 then departs from FedAvg
    mr7 = run(FedMR(stage1_rounds=5), clients, mlp.init(0), rounds=7, m=4)
    avg7 = run(get_strategy("fedavg", weighting="uniform"), clients, mlp.init(0), rounds=7, m=4)
    assert not np.array_equal(mr7.params, avg7.params)


def test_switch_timing(clients, mlp):
    """Property 10 (the two-stage scheme, §4.3): with R1 = 3, rounds 1-4 dispatch one model to
    all and round 5 dispatches K distinct models, each to one client."""
    log = drive(FedMR(stage1_rounds=3), clients, mlp, mlp.init(0), 6, m=4)
    for t, (_, tasks, _, _, metrics) in enumerate(log, start=1):
        bufs = [task.buffers["params"] for _, task in sorted(tasks.items())]
        if t <= 4:
            assert all(task.source == "global" for task in tasks.values())
            assert all(b is bufs[0] for b in bufs)
        else:
            assert all(task.source == "client" for task in tasks.values())
            assert len({b.tobytes() for b in bufs}) == 4
        assert metrics["stage"] == (1 if t <= 3 else 2)


def test_per_client_downlinks_start_each_client_from_its_model(clients, mlp):
    """Algorithm 1 line 5: slot i goes to the i-th selected client, which trains from it."""
    log = drive(FedMR(), clients, mlp, mlp.init(0), 3, m=4)
    before, tasks, updates, _, _ = log[2]
    models = FedMR.models(before)
    for i, c in enumerate(sorted(tasks)):
        assert np.array_equal(tasks[c].buffers["params"], models[i])
        params, _, _ = local_round(clients[c], models[i], tasks[c].train)
        assert np.array_equal(updates[c].buffers["params"], params)


def test_one_model_is_sequential_training(clients, mlp):
    """Property 7: K = 1 makes recombination the identity: FedMR is FedAvg with one client
    per round (one model trained by one random client after another), with or without
    stage 1, and the global model is that model."""
    a = run(FedMR(), clients, mlp.init(0), rounds=6, m=1)
    b = run(FedMR(stage1_rounds=100), clients, mlp.init(0), rounds=6, m=1)
    c = run(get_strategy("fedavg"), clients, mlp.init(0), rounds=6, m=1)
    assert np.array_equal(a.params, b.params) and np.array_equal(a.params, c.params)
    assert np.array_equal(FedMR.models(a.state)[0], a.params)
    assert all(h["permutations"] == [[0]] * 6 for h in a.history)


def test_zero_learning_rate_keeps_every_unit_multiset(clients, mlp):
    """Property 11: K = 4 distinct initial models and lr = 0: after any number of rounds the
    per-unit multisets of L_m are the initial ones and the global mean is unchanged."""
    models = np.stack([mlp.init(10 + i) for i in range(4)])
    setup = Setup(clients=sorted(clients), train=dict(TRAIN, lr=0.0), units=Setup.units_of(mlp))
    strategy = FedMR()
    state = strategy.init(mlp.init(0), setup).replace({"models": models.reshape(-1)}, slots=4)
    log = drive(strategy, clients, mlp, None, 5, m=4, train=dict(TRAIN, lr=0.0), state=state)
    units = recombination_units(setup.units, "tensor", mlp.n_params)
    mean0 = models.mean(axis=0, dtype=np.float64)
    for _, _, _, after, _ in log:
        now = FedMR.models(after)
        for unit in units:
            assert Counter(unit_bytes(r, unit) for r in now) == \
                Counter(unit_bytes(r, unit) for r in models)
        np.testing.assert_allclose(after.buffers["params"], mean0, rtol=1e-6, atol=1e-7)
    assert not np.array_equal(FedMR.models(log[-1][3]), models)


def test_bytes_equal_fedavg_and_downlinks_are_per_client(clients, mlp):
    """Property 13: K model messages of P floats down and K up per round, no other payload;
    byte counts equal FedAvg's (unicast)."""
    d = mlp.n_params
    mr = run(FedMR(stage1_rounds=2), clients, mlp.init(0), rounds=5, m=4)
    avg = run(get_strategy("fedavg"), clients, mlp.init(0), rounds=5, m=4)
    for h, g in zip(mr.history, avg.history):
        assert h["uplink_bytes"] == h["downlink_bytes"] == 4 * 4 * d
        assert (h["uplink_bytes"], h["downlink_bytes"]) == (g["uplink_bytes"], g["downlink_bytes"])
    _, tasks, updates, _, _ = drive(FedMR(), clients, mlp, mlp.init(0), 2, m=4)[1]
    assert all(list(t.buffers) == ["params"] and t.nbytes == 4 * d for t in tasks.values())
    assert all(list(u.buffers) == ["params"] and u.scalars == {} for u in updates.values())


def test_momentum_is_fresh_every_round_and_never_uploaded(clients, mlp):
    """Property 14: with local momentum 0.9 (the paper's §5.1) each local round starts from a
    zero momentum buffer (the result equals training with an explicit zero buffer, whatever
    the client trained before) and only the model is uploaded."""
    train = dict(TRAIN, momentum=0.9)
    log = drive(FedMR(), clients, mlp, mlp.init(0), 3, m=4, train=train)
    _, tasks, updates, _, _ = log[2]
    for c, task in tasks.items():
        w = np.array(task.buffers["params"], copy=True)
        kernels.local_train(mlp, w, clients[c].x, clients[c].y, dict(task.train),
                            momentum=np.zeros_like(w))
        assert np.array_equal(updates[c].buffers["params"], w)
        assert list(updates[c].buffers) == ["params"]


def test_same_seed_same_run_and_logged_permutations_replay(clients, mlp):
    """Property 15: the same seed gives the same clients, permutations and final bytes; a
    different seed does not; recombining a round's uploads with its logged permutations
    reproduces the model list exactly."""
    a = run(FedMR(stage1_rounds=1), clients, mlp.init(0), rounds=4, m=4)
    b = run(FedMR(stage1_rounds=1), clients, mlp.init(0), rounds=4, m=4)
    c = run(FedMR(stage1_rounds=1), clients, mlp.init(0), rounds=4, m=4, seed=1)
    assert a.model_sha256 == b.model_sha256 != c.model_sha256
    assert [(h["selected"], h.get("permutations")) for h in a.history] == \
        [(h["selected"], h.get("permutations")) for h in b.history]
    _, _, updates, after, metrics = drive(FedMR(), clients, mlp, mlp.init(0), 2, m=4)[1]
    units = recombination_units(Setup.units_of(mlp), "tensor", mlp.n_params)
    replayed = recombine([updates[k].buffers["params"] for k in sorted(updates)], units,
                         np.array(metrics["permutations"]))
    assert np.array_equal(replayed, FedMR.models(after))


def test_fewer_uploads_recombine_what_arrived(clients, mlp):
    """An extension (the paper assumes all K uploads arrive): a dropped client's slot is
    refilled with a received model; only the K' received models are recombined."""
    log = drive(FedMR(), clients, mlp, mlp.init(0), 1, m=4)
    before, tasks, updates, _, _ = log[0]
    kept = dict(list(sorted(updates.items()))[:3])
    after, metrics = FedMR().aggregate(1, kept, before)
    assert metrics["slots"] == 3 and FedMR.models(after).shape == (3, mlp.n_params)
    tasks2 = FedMR().configure(2, sorted(tasks), after)
    rows = [t.buffers["params"] for _, t in sorted(tasks2.items())]
    assert np.array_equal(rows[3], rows[0]) and len({r.tobytes() for r in rows[:3]}) == 3


def test_simulate_runs_the_shipped_config(tmp_path):
    """edgefl/configs/fedmr.yaml runs end to end through `edgefl simulate`."""
    from edgefl.cli import main

    out = tmp_path / "mr"
    assert main(["simulate", "fedmr", "--out", str(out), "--quiet", "--set", "rounds=4"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in rows] == [1, 1, 2, 2] and "permutations" in rows[-1]
    assert json.loads((out / "summary.json").read_text())["final_accuracy"] > 0.3
