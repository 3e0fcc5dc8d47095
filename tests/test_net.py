"""Networks: gradients against finite differences, the C core against the NumPy reference,
determinism, the momentum convention, the optional statistics, and bad input."""
import dataclasses
import threading

import numpy as np
import pytest

from edgefl import kernels, reference
from edgefl.errors import KernelError, NonFiniteError, TrainingStopped
from edgefl.models import build_model

try:
    from edgefl import _core
except ImportError:  # CI builds the core strictly; only a bare checkout lacks it
    _core = None

needs_core = pytest.mark.skipif(_core is None, reason="compiled core not built (pip install -e .)")

# C vs NumPy tolerance table (float32 everywhere; differences come from summation order and
# BLAS blocking). Relative entries are scaled by the largest magnitude of the reference value.
TOL = {
    "forward": dict(rtol=1e-5, atol=1e-5),
    "loss": dict(rtol=1e-5, atol=1e-6),
    "grad_rel": 1e-4,          # max |c - ref| / max |ref|
    "train_params": 1e-4,      # after a few steps, same scale rule
    "step_stats": dict(rtol=1e-3, atol=1e-5),
}

# Small architectures that together cover every layer (dense, conv with padding and stride,
# maxpool, ReLU, flatten) and every loss (softmax CE, logistic, MSE, squared hinge + L2).
CASES = {
    "softmax": (dict(name="softmax"), (12,), 4),
    "mlp": (dict(name="mlp", hidden=[7, 5]), (2, 3, 3), 3),
    "logreg": (dict(name="logreg"), (6,), 2),
    "linear": (dict(name="linear"), (6,), 2),
    "linear-multi": (dict(name="linear", outputs=3, bias=False), (5,), 0),
    "svm-binary": (dict(name="svm", l2=0.3), (8,), 2),
    "svm-multi": (dict(name="svm", l2=0.1, bias=True), (8,), 4),
    "cnn": (dict(name="cnn", conv=[dict(out=3, k=3, pad=1, pool=2), dict(out=4, k=2, stride=2)],
                 fc=[6]), (2, 8, 8), 3),
    "cnn-pool-stride": (dict(name="cnn", conv=[dict(out=2, k=3, stride=1, pool=3)], fc=[]),
                        (1, 9, 9), 2),
}


def make_data(case, n=11, seed=0, dtype=np.float32):
    spec, shape, classes = CASES[case]
    model = build_model(spec, shape, max(classes, 2) if classes else 0) if classes else \
        build_model(spec, shape, 0)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n,) + shape).astype(dtype)
    if model.loss == 3 and model.n_out > 1:
        y = rng.standard_normal((n, model.n_out)).astype(np.float32)
    else:
        y = rng.integers(0, max(classes, 2), n).astype(np.int32)
    return model, x, y


def split(model, y, n):
    return kernels.labels_and_targets(model, y, n)


# ----------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("case", sorted(CASES))
def test_gradient_matches_finite_differences_in_float64(case):
    model, x, y = make_data(case)
    labels, targets = split(model, y, x.shape[0])
    p = model.init(3).astype(np.float64)
    x64 = x.astype(np.float64)
    t64 = None if targets is None else targets.astype(np.float64)
    grad = np.empty_like(p)
    reference.loss_grad(grad, model, p, x64, labels, t64)
    rng = np.random.default_rng(1)
    coords = rng.choice(p.size, size=min(p.size, 40), replace=False)
    h = 1e-6
    for j in coords:
        e = np.zeros_like(p)
        e[j] = h
        g = np.empty_like(p)
        lp = reference.loss_grad(g, model, p + e, x64, labels, t64)
        lm = reference.loss_grad(g, model, p - e, x64, labels, t64)
        fd = (lp - lm) / (2 * h)
        assert abs(fd - grad[j]) <= 1e-6 + 1e-5 * abs(fd), (case, model.table.entries, j, fd, grad[j])


@pytest.mark.parametrize("preset,shape", [("cnn-mnist", (1, 28, 28)), ("cnn-cifar", (3, 32, 32)),
                                          ("lenet-cifar", (3, 32, 32))])
def test_preset_gradients_match_finite_differences(preset, shape):
    model = build_model(preset, shape, 10)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2,) + shape)
    y = np.array([3, 7], dtype=np.int32)
    p = model.init(0).astype(np.float64)
    grad = np.empty_like(p)
    reference.loss_grad(grad, model, p, x, y, None)
    # one coordinate in every parameter tensor, where the signal is largest
    for e in model.table.entries:
        j = e.offset + int(np.argmax(np.abs(grad[e.offset:e.offset + e.size])))
        d = np.zeros_like(p)
        d[j] = 1e-6
        g = np.empty_like(p)
        fd = (reference.loss_grad(g, model, p + d, x, y, None)
              - reference.loss_grad(g, model, p - d, x, y, None)) / 2e-6
        assert abs(fd - grad[j]) <= 1e-6 + 1e-4 * abs(fd), (preset, e.name, fd, grad[j])


def test_preset_parameter_counts_match_the_papers():
    assert build_model("cnn-mnist", (1, 28, 28), 10).n_params == 1_663_370   # FedAvg paper
    assert build_model("cnn-cifar", (3, 32, 32), 10).n_params == 797_962     # FedUmf, App. A
    assert build_model("lenet-cifar", (3, 32, 32), 10).n_params == 62_006    # FedMR's CNNCifar
    assert build_model({"name": "mlp", "hidden": [200, 200]}, (784,), 10).n_params == 199_210


# ----------------------------------------------------------------------------- C vs NumPy

def close_rel(a, b, rel):
    scale = max(float(np.max(np.abs(b))), 1e-12)
    return float(np.max(np.abs(a.astype(np.float64) - b))) / scale <= rel


@needs_core
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_loss_grad_evaluate_parity(case):
    model, x, y = make_data(case, n=150)  # > one evaluation chunk
    labels, targets = split(model, y, x.shape[0])
    p = model.init(5)
    p_before, x_before = p.copy(), x.copy()
    outs = [np.full((x.shape[0], model.n_out), np.nan, np.float32) for _ in range(2)]
    _core.forward(outs[0], model, p, x)
    reference.forward(outs[1], model, p, x)
    np.testing.assert_allclose(outs[0], outs[1], **TOL["forward"])
    grads = [np.full(model.n_params, np.nan, np.float32) for _ in range(2)]
    l_c = _core.loss_grad(grads[0], model, p, x, labels, targets)
    l_r = reference.loss_grad(grads[1], model, p, x, labels, targets)
    np.testing.assert_allclose(l_c, l_r, **TOL["loss"])
    assert close_rel(grads[0], grads[1], TOL["grad_rel"])
    (s_c, k_c), (s_r, k_r) = (_core.evaluate(model, p, x, labels, targets),
                              reference.evaluate(model, p, x, labels, targets))
    np.testing.assert_allclose(s_c, s_r, **TOL["loss"])
    assert k_c == k_r
    # inputs untouched
    np.testing.assert_array_equal(p, p_before)
    np.testing.assert_array_equal(x, x_before)


@needs_core
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mode", ["epochs-momentum-wd", "steps-grad0-batch", "full-batch-grad0-full"])
def test_local_train_parity_with_every_mutated_argument(case, mode):
    model, x, y = make_data(case, n=23)
    labels, targets = split(model, y, x.shape[0])
    if mode == "epochs-momentum-wd":
        cfg = kernels.train_config(lr=0.05, momentum=0.9, weight_decay=1e-3, batch_size=5,
                                   epochs=2, seed=11)
    elif mode == "steps-grad0-batch":
        cfg = kernels.train_config(lr=0.05, batch_size=4, steps=9, grad0_mode="batch", seed=2)
    else:
        cfg = kernels.train_config(lr=0.05, batch_size=0, epochs=3, grad0_mode="full", seed=2)
    steps = kernels.planned_steps(cfg, x.shape[0])
    results = []
    for impl in (_core, reference):
        p = model.init(7)
        mom = np.full(model.n_params, 0.25, np.float32)
        g0 = np.full(model.n_params, np.nan, np.float32) if cfg["grad0_mode"] else None
        gsum = np.zeros(model.n_params, np.float32)
        stats = np.full((steps, 3), np.nan) if g0 is not None else None
        res = impl.local_train(p, mom, model, x, labels, targets, cfg, grad0=g0, grad_sum=gsum,
                               step_stats=stats)
        results.append((p, mom, g0, gsum, stats, res))
    (p1, m1, g1, s1, st1, r1), (p2, m2, g2, s2, st2, r2) = results
    assert r1["steps"] == r2["steps"] == steps
    assert r1["samples"] == r2["samples"]
    np.testing.assert_allclose(r1["mean_loss"], r2["mean_loss"], rtol=1e-4, atol=1e-6)
    for a, b in ((p1, p2), (m1, m2), (s1, s2)):
        assert close_rel(a, b, TOL["train_params"])
    if g1 is not None:
        assert close_rel(g1, g2, TOL["grad_rel"])
        np.testing.assert_allclose(st1, st2, **TOL["step_stats"])


@needs_core
def test_pooling_ties_and_fused_relu_match_the_reference():
    """Integer images and integer conv weights make pooling windows of exact ties between
    different input patches (so which maximum gets the gradient changes the weight gradient),
    and windows whose maximum is 0 or negative. The C core runs ReLU+pool as one pool that
    records where each maximum sits; its gradient must go to the same (first) maximum as the
    reference's and pass nothing where the ReLU blocks."""
    model = build_model(dict(name="cnn", conv=[dict(out=4, k=3, pad=1, pool=2),
                                              dict(out=3, k=3, pad=1, pool=2)], fc=[5]),
                        (1, 12, 12), 3)
    rng = np.random.default_rng(4)
    x = np.zeros((40, 1, 12, 12), np.float32)
    x[:, :, 3:9, 3:9] = rng.integers(0, 3, (40, 1, 6, 6))
    y = rng.integers(0, 3, 40).astype(np.int32)
    p = model.init(2)
    for e in model.table.entries:
        if e.name.startswith("conv") and e.name.endswith("weight"):
            p[e.offset:e.offset + e.size] = rng.integers(-1, 2, e.size)
        if e.name.startswith("conv") and e.name.endswith("bias"):  # maxima of both signs
            p[e.offset:e.offset + e.size] = np.linspace(-1.5, 1.5, e.size)
    grads = [np.full(model.n_params, np.nan, np.float32) for _ in range(2)]
    l_c = _core.loss_grad(grads[0], model, p, x, y, None)
    l_r = reference.loss_grad(grads[1], model, p, x, y, None)
    np.testing.assert_allclose(l_c, l_r, **TOL["loss"])
    assert close_rel(grads[0], grads[1], TOL["grad_rel"])
    np.testing.assert_array_equal(grads[0] == 0, grads[1] == 0)


@needs_core
def test_shuffle_is_the_same_permutation_in_both_backends():
    for seed, epoch, n in [(0, 0, 1), (1, 0, 10), (2**63 + 5, 7, 1000), (42, 3, 60000)]:
        perm = _core.shuffle(seed, epoch, n)
        np.testing.assert_array_equal(perm, reference.shuffle(seed, epoch, n))
        assert sorted(perm.tolist()) == list(range(n))
    assert not np.array_equal(_core.shuffle(1, 0, 100), _core.shuffle(1, 1, 100))


@pytest.mark.parametrize("impl", [pytest.param(_core, marks=needs_core, id="c"),
                                  pytest.param(reference, id="numpy")])
def test_shuffle_takes_epochs_and_sizes_both_backends_can(impl, monkeypatch):
    """The last epoch an int64 holds has its key (C computed epoch + 1 in int64: signed
    overflow, which UBSan reports); a negative epoch or size is refused by name, where C
    returned a permutation and the twin raised OverflowError from NumPy."""
    want = reference.shuffle(9, 2 ** 63 - 1, 50)
    monkeypatch.setattr(kernels, "impl", impl)
    np.testing.assert_array_equal(kernels.shuffle(9, 2 ** 63 - 1, 50), want)
    with pytest.raises(KernelError, match=r"shuffle: epoch -2 must be in \[0, 2\^63\)"):
        kernels.shuffle(9, -2, 50)
    with pytest.raises(KernelError, match=r"shuffle: n -1 must be >= 0"):
        kernels.shuffle(9, 0, -1)
    assert kernels.shuffle(9, 0, 0).tolist() == []


def test_misaligned_params_are_refused_by_the_training_fast_path():
    model, x, y = make_data("mlp", n=8)
    p = np.zeros(model.n_params * 4 + 1, np.uint8)[1:].view(np.float32)
    p[...] = model.init(0)
    with pytest.raises(KernelError, match="params: array is not aligned for float32"):
        kernels.local_train(model, p, x, y, kernels.train_config(batch_size=4, epochs=1))


# ----------------------------------------------------------------------------- semantics

def test_same_seed_same_bytes_different_seed_different_bytes():
    model, x, y = make_data("cnn", n=40)
    out = []
    for seed in (5, 5, 6):
        p = model.init(0)
        cfg = kernels.train_config(lr=0.1, batch_size=8, epochs=2, seed=seed)
        kernels.local_train(model, p, x, y, cfg)
        out.append(p.tobytes())
    assert out[0] == out[1]
    assert out[0] != out[2]
    assert model.init(3).tobytes() == model.init(3).tobytes() != model.init(4).tobytes()


def test_momentum_follows_pytorch_convention_by_hand():
    """d = gamma d + g; w -= eta d (the MFL paper's (6)-(7)). Model: w*x with x=1, y=0, loss w^2/2,
    so g = w. eta=0.1, gamma=0.9, w0=1: w = 0.9, 0.72, 0.486 and d = 1, 1.8, 2.34; the
    `v = gamma v + eta g` convention would leave v = 0.234 in the buffer."""
    model = build_model(dict(name="linear", bias=False), (1,), 0)
    x = np.ones((1, 1), np.float32)
    y = np.zeros((1, 1), np.float32)
    w_seq, d_seq = [], []
    p = np.ones(1, np.float32)
    d = np.zeros(1, np.float32)
    for _ in range(3):
        kernels.local_train(model, p, x, y, kernels.train_config(lr=0.1, momentum=0.9, batch_size=0,
                                                                 steps=1), momentum=d)
        w_seq.append(float(p[0]))
        d_seq.append(float(d[0]))
    np.testing.assert_allclose(w_seq, [0.9, 0.72, 0.486], rtol=1e-6)
    np.testing.assert_allclose(d_seq, [1.0, 1.8, 2.34], rtol=1e-6)
    # weight decay joins the gradient before momentum: g = w + wd*w
    p[:] = 1.0
    d[:] = 0.0
    kernels.local_train(model, p, x, y, kernels.train_config(lr=0.1, momentum=0.9, weight_decay=0.5,
                                                             batch_size=0, steps=1), momentum=d)
    np.testing.assert_allclose([p[0], d[0]], [1 - 0.1 * 1.5, 1.5], rtol=1e-6)


def test_zero_momentum_buffer_gives_plain_sgd_bit_for_bit():
    model, x, y = make_data("mlp", n=30)
    a, b = model.init(1), model.init(1)
    cfg = kernels.train_config(lr=0.1, batch_size=4, epochs=2, seed=9)
    kernels.local_train(model, a, x, y, cfg)
    d = np.zeros_like(b)
    kernels.local_train(model, b, x, y, cfg, momentum=d)
    assert a.tobytes() == b.tobytes()


def test_full_batch_training_is_gradient_descent():
    model, x, y = make_data("svm-binary", n=17)
    p = model.init(2)
    manual = p.copy()
    for _ in range(4):
        _, g = kernels.loss_grad(model, manual, x, y)
        manual -= np.float32(0.2) * g
    kernels.local_train(model, p, x, y, kernels.train_config(lr=0.2, batch_size=0, epochs=4))
    np.testing.assert_allclose(p, manual, rtol=1e-5, atol=1e-6)


def test_statistics_mean_what_they_say():
    model, x, y = make_data("mlp", n=40)
    cfg = kernels.train_config(lr=0.05, batch_size=8, steps=7, grad0_mode="batch", seed=4)
    p0 = model.init(0)
    p = p0.copy()
    g0, gsum = np.empty_like(p), np.zeros_like(p)
    stats = np.zeros((7, 3))
    kernels.local_train(model, p, x, y, cfg, grad0=g0, grad_sum=gsum, step_stats=stats)
    # grad0 (batch mode) = gradient at the start point on the first minibatch
    first = kernels.shuffle(4, 0, 40)[:8]
    _, g_first = kernels.loss_grad(model, p0, np.ascontiguousarray(x[first]), y[first])
    np.testing.assert_allclose(g0, g_first, rtol=1e-4, atol=1e-6)
    # plain SGD: the end point is the start minus lr times the running gradient sum
    np.testing.assert_allclose(p, p0 - np.float32(0.05) * gsum, rtol=1e-4, atol=1e-5)
    assert stats[0, 0] == pytest.approx(0.0, abs=1e-6) and stats[0, 1] == 0.0
    assert np.all(stats[1:, 1] > 0)
    np.testing.assert_allclose(stats[-1, 2], float(np.dot(gsum.astype(np.float64), gsum)), rtol=1e-4)
    # full mode = gradient over all local data
    g_full = np.empty_like(p)
    kernels.local_train(model, p0.copy(), x, y, kernels.train_config(
        lr=0.05, batch_size=8, steps=1, grad0_mode="full"), grad0=g_full)
    np.testing.assert_allclose(g_full, kernels.loss_grad(model, p0, x, y)[1], rtol=1e-4, atol=1e-6)


def test_steps_cross_epoch_boundaries_and_count_samples():
    model, x, y = make_data("softmax", n=10)
    res = kernels.local_train(model, model.init(0), x, y,
                              kernels.train_config(lr=0.1, batch_size=4, steps=7))
    assert res["steps"] == 7
    assert res["samples"] == 4 + 4 + 2 + 4 + 4 + 2 + 4


def test_training_reduces_loss_on_a_learnable_task():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 10)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int32)
    model = build_model("softmax", (10,), 2)
    p = model.init(0)
    before = kernels.evaluate(model, p, x, y)
    kernels.local_train(model, p, x, y, kernels.train_config(lr=0.5, batch_size=16, epochs=5))
    after = kernels.evaluate(model, p, x, y)
    assert after["loss"] < 0.5 * before["loss"]
    assert after["accuracy"] > 0.95


def test_evaluate_includes_the_l2_term_like_the_training_loss():
    model, x, y = make_data("svm-binary", n=20)
    p = model.init(1)
    loss, _ = kernels.loss_grad(model, p, x, y)
    assert kernels.evaluate(model, p, x, y)["loss"] == pytest.approx(loss, rel=1e-5)


# ----------------------------------------------------------------------------- bad input

def test_bad_inputs_name_the_cause():
    model, x, y = make_data("cnn", n=12)
    p = model.init(0)
    cfg = kernels.train_config(lr=0.1, batch_size=4, epochs=1)
    with pytest.raises(KernelError, match="x: dtype float64"):
        kernels.local_train(model, p, x.astype(np.float64), y, cfg)
    with pytest.raises(KernelError, match="not C-contiguous"):
        kernels.forward(model, p, np.asfortranarray(x.reshape(12, -1)))
    with pytest.raises(KernelError, match=r"samples of shape \(2, 7, 8\)"):
        kernels.forward(model, p, np.ascontiguousarray(x[:, :, :7, :]))
    with pytest.raises(KernelError, match="no samples"):
        kernels.local_train(model, p, x[:0], y[:0], cfg)
    with pytest.raises(KernelError, match="parameters"):
        kernels.local_train(model, np.zeros(p.size + 1, np.float32), x, y, cfg)
    with pytest.raises(KernelError, match="labels span"):
        kernels.local_train(model, p, x, y + 10, cfg)
    with pytest.raises(KernelError, match="3 labels for 12 samples"):
        kernels.evaluate(model, p, x, y[:3])
    with pytest.raises(KernelError, match=r"y: a scalar \(shape \(\)\), not one label a sample"):
        kernels.evaluate(model, p, x, np.array(0))
    with pytest.raises(KernelError, match="momentum buffer is required"):
        kernels.local_train(model, p, x, y, kernels.train_config(lr=0.1, momentum=0.5))
    with pytest.raises(KernelError, match="unknown key"):
        kernels.train_config(learning_rate=0.1)
    with pytest.raises(KernelError, match="momentum = 1.0 must be < 1"):
        kernels.train_config(momentum=1.0)
    ro = p.copy()
    ro.setflags(write=False)
    with pytest.raises(KernelError, match="read-only"):
        kernels.local_train(model, ro, x, y, cfg)
    other = build_model("softmax", (2, 8, 8), 3)
    with pytest.raises(KernelError, match="does not match"):
        other.table.require_same(model.table, "checkpoint")


@pytest.mark.parametrize("impl", [pytest.param(_core, marks=needs_core, id="c"),
                                  pytest.param(reference, id="numpy")])
def test_train_counts_past_int32_are_refused_by_name(impl, monkeypatch):
    """ef_train_cfg's batch_size, epochs and steps are int32: 2**31 reached the C binding as
    an OverflowError that named no key ("value too large to convert to int32_t"), and the
    twin ran it. Refused by train_config, by key, in both backends."""
    monkeypatch.setattr(kernels, "impl", impl)
    for key in ("batch_size", "epochs", "steps"):
        with pytest.raises(KernelError, match=rf"train config: {key} = 2147483648 must be "
                                              rf"within int32"):
            kernels.train_config(**{key: 2 ** 31})
    with pytest.raises(KernelError, match=r"train config: batch_size = -2147483649 must be "
                                          r"within int32"):
        kernels.train_config(batch_size=-2 ** 31 - 1)
    model, x, y = make_data("mlp", n=6)
    out = kernels.local_train(model, model.init(0), x, y,
                              kernels.train_config(batch_size=2 ** 31 - 1, epochs=1))
    assert out["steps"] == 1 and out["samples"] == 6


@pytest.mark.parametrize("impl", [pytest.param(_core, marks=needs_core, id="c"),
                                  pytest.param(reference, id="numpy")])
def test_shuffle_refuses_a_seed_outside_uint64_by_name(impl, monkeypatch):
    """train_config refuses such a seed by name; kernels.shuffle passed it on, to an
    OverflowError from Cython or NumPy."""
    monkeypatch.setattr(kernels, "impl", impl)
    for seed in (-1, 2 ** 64):
        with pytest.raises(KernelError, match=rf"shuffle: seed {seed} must be in \[0, 2\^64\)"):
            kernels.shuffle(seed, 0, 5)
    assert kernels.shuffle(2 ** 64 - 1, 0, 5).tolist() == reference.shuffle(2 ** 64 - 1, 0, 5).tolist()


@pytest.mark.parametrize("case", ["cnn", "linear-multi", "logreg"])
def test_samples_are_checked_once_and_cannot_go_stale(case):
    """kernels.Samples checks x and y once for every round on the same data; it keeps its
    own read-only labels/targets, so mutating the caller's y afterwards cannot put an
    out-of-range label in front of the C core, and training on it is bit-identical to
    local_train on the arrays."""
    model, x, y = make_data(case, n=20)
    data = kernels.Samples(model, x, y)
    kept = (data.labels if data.labels is not None else data.targets).copy()
    for a in (data.labels, data.targets):
        if a is not None:
            assert not a.flags.writeable and not np.shares_memory(a, y)
    y_before = y.copy()
    y[:] = 10 ** 6 if y.dtype.kind == "i" else np.nan
    np.testing.assert_array_equal(data.labels if data.labels is not None else data.targets, kept)
    cfg = kernels.train_config(lr=0.05, batch_size=6, epochs=2, seed=3)
    a, b = model.init(1), model.init(1)
    r1 = kernels.train_samples(data, a, cfg)
    r2 = kernels.local_train(model, b, x, y_before, cfg)
    assert a.tobytes() == b.tobytes() and r1 == r2
    assert kernels.evaluate_samples(data, a) == kernels.evaluate(model, a, x, y_before)
    with pytest.raises(KernelError, match="labels span|targets are not all finite"):
        kernels.Samples(model, x, y)
    with pytest.raises(KernelError, match="parameters"):
        kernels.train_samples(data, np.zeros(a.size + 1, np.float32), cfg)


def test_non_finite_loss_stops_and_names_the_step():
    model, x, y = make_data("mlp", n=16)
    x = x.copy()
    x[9] = np.inf  # sample 9 poisons whichever minibatch it lands in
    p = model.init(0)
    cfg = kernels.train_config(lr=0.1, batch_size=4, epochs=1, seed=1)
    bad_step = int(np.where(kernels.shuffle(1, 0, 16) == 9)[0][0]) // 4
    with pytest.raises(NonFiniteError, match=f"step {bad_step}") as info:
        kernels.local_train(model, p, x, y, cfg)
    assert info.value.step == bad_step
    assert np.all(np.isfinite(p))
    with pytest.raises(NonFiniteError, match="step"):
        kernels.local_train(model, model.init(0), make_data("mlp", n=16)[1], y,
                            kernels.train_config(lr=1e30, batch_size=4, epochs=3))


# ----------------------------------------------------------------------------- proximal term
# FedProx (Li et al., MLSys 2020): with train prox_mu = mu every local step adds the gradient
# of mu/2 ||w - anchor||^2, mu * (w - anchor), after weight decay and before momentum.

IMPLS = [pytest.param(reference, id="numpy"), pytest.param(_core, id="c", marks=needs_core)]
PROX_CASES = ["softmax", "mlp", "cnn", "cnn-pool-stride", "svm-multi", "logreg"]


def _anchor_near(model, seed):
    """A read-only anchor 0.1 away from model.init(seed) per coordinate, so the proximal
    term pulls from the first step on (with anchor = start it starts at step 2)."""
    a = model.init(seed)
    a += np.float32(0.1) * np.random.default_rng(seed).standard_normal(a.size).astype(np.float32)
    a.flags.writeable = False
    return a


@needs_core
@pytest.mark.parametrize("case", PROX_CASES)
@pytest.mark.parametrize("mode", ["epochs", "steps-momentum-wd", "anchor-is-start"])
def test_proximal_training_parity(case, mode):
    model, x, y = make_data(case, n=23)
    labels, targets = split(model, y, x.shape[0])
    if mode == "steps-momentum-wd":
        cfg = kernels.train_config(lr=0.05, prox_mu=0.7, momentum=0.9, weight_decay=1e-3,
                                   batch_size=4, steps=9, seed=2)
    else:
        cfg = kernels.train_config(lr=0.05, prox_mu=0.3, batch_size=5, epochs=2, seed=11)
    anchor = model.init(7) if mode == "anchor-is-start" else _anchor_near(model, 7)
    results = []
    for impl, mu in ((_core, cfg["prox_mu"]), (reference, cfg["prox_mu"]), (_core, 0.0)):
        p = model.init(7)
        mom = np.zeros_like(p) if cfg["momentum"] else None
        gsum = np.zeros_like(p)
        res = impl.local_train(p, mom, model, x, labels, targets, dict(cfg, prox_mu=mu),
                               grad_sum=gsum, anchor=anchor)
        results.append((p, mom, gsum, res))
    (p1, m1, s1, r1), (p2, m2, s2, r2), (p_sgd, _, _, _) = results
    assert r1["steps"] == r2["steps"] and r1["samples"] == r2["samples"]
    np.testing.assert_allclose(r1["mean_loss"], r2["mean_loss"], rtol=1e-4, atol=1e-6)
    assert close_rel(p1, p2, TOL["train_params"]) and close_rel(s1, s2, TOL["train_params"])
    if m1 is not None:
        assert close_rel(m1, m2, TOL["train_params"])
    # the term mattered: parity above is not the parity of two plain SGD runs
    assert not close_rel(p1, p_sgd, 10 * TOL["train_params"])
    # and it pulls towards the anchor
    dist = [float(np.linalg.norm(p.astype(np.float64) - anchor)) for p in (p1, p_sgd)]
    assert dist[0] < dist[1]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ["softmax", "mlp", "cnn"])
def test_zero_mu_is_plain_sgd_bit_for_bit(impl, case):
    """prox_mu = 0 (or -0.0) skips the term: the same bits as a call without an anchor, even
    with an all-NaN anchor, which any `+ 0 * (w - anchor)` would spread to every weight."""
    model, x, y = make_data(case, n=23)
    labels, targets = split(model, y, x.shape[0])
    cfg = kernels.train_config(lr=0.05, momentum=0.9, weight_decay=1e-3, batch_size=5, epochs=2,
                               seed=3)
    assert cfg["prox_mu"] == 0.0
    runs = []
    for mu, anchor in ((None, None), (0.0, np.full(model.n_params, np.nan, np.float32)),
                       (-0.0, np.full(model.n_params, np.nan, np.float32))):
        p, mom = model.init(5), np.zeros(model.n_params, np.float32)
        run_cfg = cfg if mu is None else kernels.train_config(**dict(cfg, prox_mu=mu))
        res = impl.local_train(p, mom, model, x, labels, targets, run_cfg, anchor=anchor)
        runs.append((p.tobytes(), mom.tobytes(), res))
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize("impl", IMPLS)
def test_proximal_steps_by_hand(impl):
    """Loss w^2/2 (one sample x = 1, target 0, linear model without bias), so grad F(w) = w.
    From w0 = 1 with the anchor at the start point, lr 0.1, mu 0.5:
        step 1: g = 1 + 0.5 (1 - 1) = 1,                w = 0.9
        step 2: g = 0.9 + 0.5 (0.9 - 1) = 0.85,        w = 0.815
        step 3: g = 0.815 + 0.5 (0.815 - 1) = 0.7225,  w = 0.74275
    where plain SGD ends at 0.9**3 = 0.729."""
    model = build_model(dict(name="linear", bias=False), (1,), 0)
    x = np.ones((1, 1), np.float32)
    labels, targets = split(model, np.zeros((1, 1), np.float32), 1)
    anchor = np.ones(1, np.float32)
    ends = []
    for mu in (0.5, 0.0):
        p = np.ones(1, np.float32)
        impl.local_train(p, None, model, x, labels, targets,
                         kernels.train_config(lr=0.1, prox_mu=mu, batch_size=0, steps=3),
                         anchor=anchor)
        ends.append(float(p[0]))
    np.testing.assert_allclose(ends, [0.74275, 0.729], rtol=1e-6)
    assert anchor[0] == 1.0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ["mlp", "cnn"])
def test_one_proximal_step_is_the_formula(impl, case):
    """One full-batch step: w1 = w0 - lr (grad F(w0) + mu (w0 - anchor)), in float32."""
    model, x, y = make_data(case, n=13)
    labels, targets = split(model, y, x.shape[0])
    w0, anchor = model.init(2), _anchor_near(model, 9)
    grad = np.empty_like(w0)
    impl.loss_grad(grad, model, w0, x, labels, targets)
    lr, mu = np.float32(0.2), np.float32(0.3)
    want = w0 - lr * (grad + mu * (w0 - anchor))
    p = w0.copy()
    impl.local_train(p, None, model, x, labels, targets,
                     kernels.train_config(lr=0.2, prox_mu=0.3, batch_size=0, steps=1),
                     anchor=anchor)
    np.testing.assert_allclose(p, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(p, w0 - lr * grad, rtol=1e-5, atol=1e-6)


def test_bad_proximal_settings_name_the_cause():
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(KernelError, match=f"prox_mu = {bad} must be finite and >= 0"):
            kernels.train_config(prox_mu=bad)
    model, x, y = make_data("mlp", n=12)
    cfg = kernels.train_config(lr=0.1, prox_mu=0.1, batch_size=4, epochs=1)
    p = model.init(0)
    with pytest.raises(KernelError, match=r"anchor: the proximal term \(prox_mu = 0.1\) needs"):
        kernels.local_train(model, p, x, y, cfg)
    with pytest.raises(KernelError, match="anchor: .* parameters"):
        kernels.local_train(model, p, x, y, cfg, anchor=np.zeros(p.size - 1, np.float32))
    with pytest.raises(KernelError, match="anchor: dtype float64"):
        kernels.local_train(model, p, x, y, cfg, anchor=p.astype(np.float64))
    with pytest.raises(KernelError, match="anchor: shares memory with params"):
        kernels.local_train(model, p, x, y, cfg, anchor=p)
    assert p.tobytes() == model.init(0).tobytes()


@needs_core
def test_the_c_core_refuses_a_bad_mu_itself():
    """Past kernels.py's checks (a caller of _core directly), ef_local_train still refuses."""
    model, x, y = make_data("mlp", n=12)
    labels, _ = split(model, y, 12)
    cfg = kernels.train_config(lr=0.1, batch_size=4, epochs=1)
    p = model.init(0)
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(KernelError, match="rejected the arguments"):
            _core.local_train(p, None, model, x, labels, None, dict(cfg, prox_mu=bad),
                              anchor=model.init(1))
    with pytest.raises(KernelError, match="anchor: expected a numpy array"):
        _core.local_train(p, None, model, x, labels, None, dict(cfg, prox_mu=0.5))
    assert p.tobytes() == model.init(0).tobytes()



@needs_core
def test_the_c_core_refuses_a_layer_table_value_beyond_int32():
    """The table is int64 and the C layer's fields int32: a value past 2**31 - 1 (a
    hand-built table, a caller of _core directly) was cast down, so 2**32 + 10 outputs
    became 10 -- a table the C core then found consistent and ran. Refused by layer and
    column before any C call."""
    model, x, y = make_data("mlp", n=12)
    layers = model.layers.copy()
    last = len(layers) - 1
    layers[last, 4] += 2 ** 32
    layers.setflags(write=False)
    bad = dataclasses.replace(model, layers=layers)
    out = np.full((len(x), model.n_out), 7.0, np.float32)
    with pytest.raises(KernelError, match=rf"net.layers\[{last}, 4\] \(out_c\): "
                                          rf"{layers[last, 4]} is outside int32"):
        _core.forward(out, bad, model.init(0), x)
    assert (out == 7.0).all()


# A consistent layer table whose sizes pass what the C core indexes: a 1x1 input padded by
# 2^30 at stride 2 gives a 2^30 + 1 square (2^60 floats per sample), which a second conv of
# stride 2^30 + 1 brings back to 1x1. Every field fits int32, so fill_net passed it; the padded
# side 1 + 2^31 overflowed int32 in csrc/net.c's padded_size and the activation times the
# chunk overflowed int64, and the workspace the layout then sized was smaller than what the
# kernels wrote: a segfault (heap overflow) in the normal build.
HUGE_CONV_SPEC = dict(name="cnn", conv=[dict(out=1, k=1, stride=2, pad=2 ** 30),
                                        dict(out=1, k=1, stride=2 ** 30 + 1)], fc=[])


def test_a_model_whose_activations_pass_int32_is_refused_when_built():
    with pytest.raises(KernelError, match=r"model: conv k=1 stride=2 pad=1073741824 on input "
                                          r"\(1, 1, 1\): padded input 2147483649 x 2147483649"):
        build_model(HUGE_CONV_SPEC, (1, 1, 1), 2)
    with pytest.raises(KernelError, match=r"model: conv k=1 stride=2 pad=536870912 on input "
                                          r"\(1, 1, 1\): output \(1, 536870913, 536870913\) "
                                          r"has 288230377225453569 values per sample"):
        build_model(dict(HUGE_CONV_SPEC, conv=[dict(out=1, k=1, stride=2, pad=2 ** 29)]),
                    (1, 1, 1), 2)
    with pytest.raises(KernelError, match=r"model: input_shape \(2097152, 2097152, 2097152\) "
                                          r"has 9223372036854775808 values per sample"):
        build_model("softmax", (2 ** 21,) * 3, 3)
    # the max pool's argmax is int32 over a chunk of 128 samples
    with pytest.raises(KernelError, match=r"model: maxpool k=2 on input \(1, 4097, 4097\) "
                                          r"\(16785409 values per sample\)"):
        build_model(dict(name="cnn", conv=[dict(out=1, k=1, pool=2)], fc=[]), (1, 4097, 4097), 2)


@needs_core
@pytest.mark.parametrize("n", [1, 8])
def test_the_c_core_refuses_a_layer_table_whose_sizes_overflow(tmp_path, n):
    """Past the builder (a hand-built table, a caller of _core directly), ef_workspace_size
    refuses the table: a KernelError, not a crash. In a child process, since before the fix
    the call died of SIGSEGV."""
    script = tmp_path / "probe.py"
    script.write_text(f"""
import dataclasses
import numpy as np
from edgefl import _core
from edgefl.errors import KernelError
from edgefl.models import build_model
base = build_model(dict(name="cnn", conv=[dict(out=1, k=1), dict(out=1, k=1)], fc=[]), (1, 1, 1), 2)
big = 2 ** 30 + 1
layers = base.layers.copy()
layers[0, 4:10] = [1, big, big, 1, 2, 2 ** 30]
layers[1, 1:7] = [1, big, big, 1, big, big]
layers[2, 1:4] = [1, big, big]
layers[2, 7:10] = [1, big, 0]
layers.setflags(write=False)
bad = dataclasses.replace(base, layers=layers)
p, x, y = base.init(0), np.ones(({n}, 1, 1, 1), np.float32), np.zeros({n}, np.int32)
try:
    _core.evaluate(bad, p, x, y, None)
except KernelError as exc:
    print("refused:", exc)
""")
    import subprocess
    import sys
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-2000:]}"
    assert "refused: net: inconsistent layer table" in run.stdout

# ---------------------------------------------------------------------------------------
# the stop word: a local round stops before any step once asked (issue #18 item 6)
# ---------------------------------------------------------------------------------------

STOP_MODES = {
    "epochs-momentum-wd": dict(lr=0.05, momentum=0.9, weight_decay=1e-3, batch_size=5,
                               epochs=3, seed=11),
    "steps-grad0-batch": dict(lr=0.05, batch_size=4, steps=9, grad0_mode="batch", seed=2),
    "full-batch-prox": dict(lr=0.05, batch_size=0, epochs=6, prox_mu=0.3, seed=2),
}


def _train_stopped(impl, model, x, labels, targets, cfg, flag):
    """local_train from fixed buffers with `flag`'s word; (buffers, TrainingStopped or the
    result dict)."""
    p = model.init(7)
    anchor = model.init(8)
    mom = np.zeros(model.n_params, np.float32)
    g0 = np.full(model.n_params, np.nan, np.float32) if cfg["grad0_mode"] else None
    gsum = np.zeros(model.n_params, np.float32)
    try:
        out = impl.local_train(p, mom, model, x, labels, targets, cfg, grad0=g0, grad_sum=gsum,
                               anchor=anchor, stop_word=None if flag is None else flag.word)
    except TrainingStopped as exc:
        out = exc
    return (p, mom, gsum, g0), out


@needs_core
@pytest.mark.parametrize("case", ["mlp", "cnn", "svm-multi"])
@pytest.mark.parametrize("mode", sorted(STOP_MODES))
def test_a_stopped_round_is_the_same_in_c_and_numpy_and_equals_a_shorter_round(case, mode):
    """Stopped after k steps (the word set to k + 1 before the call: deterministic), both
    backends raise TrainingStopped with k steps and the same samples, and leave the same
    parameters, momentum and gradient sum; in each backend they are bit for bit those of a
    round of exactly k steps. k = 0 leaves the buffers untouched."""
    model, x, y = make_data(case, n=23)
    labels, targets = split(model, y, x.shape[0])
    cfg = kernels.train_config(**STOP_MODES[mode])
    total = kernels.planned_steps(cfg, x.shape[0])
    for k in (0, 1, 4, total - 1):
        flag = kernels.StopFlag()
        flag.stop_after_steps(k)
        runs = {}
        for impl in (_core, reference):
            buffers, stopped = _train_stopped(impl, model, x, labels, targets, cfg, flag)
            assert isinstance(stopped, TrainingStopped), (impl.__name__, k, stopped)
            assert stopped.steps == k, (impl.__name__, k, stopped.steps)
            short = dict(cfg, steps=k, epochs=0) if k else None
            if short is not None:   # the same k steps as a round that plans k steps
                same, done = _train_stopped(impl, model, x, labels, targets, short, None)
                assert done["steps"] == k and done["samples"] == stopped.samples
                assert done["mean_loss"] == stopped.mean_loss
                for a, b in zip(buffers, same):
                    if a is not None:
                        np.testing.assert_array_equal(a, b)
            else:
                assert stopped.samples == 0
                np.testing.assert_array_equal(buffers[0], model.init(7))
            runs[impl] = buffers, stopped
        (b1, s1), (b2, s2) = runs[_core], runs[reference]
        assert s1.samples == s2.samples
        np.testing.assert_allclose(s1.mean_loss, s2.mean_loss, rtol=1e-4, atol=1e-6)
        for a, b in zip(b1, b2):
            if a is None:
                continue
            if k == 0:              # untouched in both (grad0 still NaN)
                np.testing.assert_array_equal(a, b)
            else:
                assert close_rel(a, b, TOL["train_params"]), (k, mode)
        # the word is only read: a later call with the word cleared runs the whole round
        flag.clear()
        _, done = _train_stopped(_core, model, x, labels, targets, cfg, flag)
        assert done["steps"] == total


@pytest.mark.parametrize("impl_name", ["c", "numpy"])
def test_another_thread_stops_a_long_round_while_it_trains(impl_name):
    """The word set by another thread while a round trains stops it before its next step: the
    C core reads it with the interpreter lock released (so the setting thread runs at all),
    the NumPy twin reads it every step. The round planned a million steps; it raises
    TrainingStopped with far fewer, and the parameters are those of the steps it did."""
    if impl_name == "c" and _core is None:
        pytest.skip("compiled core not built")
    impl = _core if impl_name == "c" else reference
    model, x, y = make_data("softmax", n=64)
    labels, targets = split(model, y, x.shape[0])
    cfg = kernels.train_config(lr=0.01, batch_size=8, steps=1_000_000, seed=3)
    flag = kernels.StopFlag()
    p = model.init(1)
    outcome = {}
    started = threading.Event()

    def train():
        started.set()
        try:
            outcome["result"] = impl.local_train(p, None, model, x, labels, targets, cfg,
                                                 stop_word=flag.word)
        except TrainingStopped as exc:
            outcome["stopped"] = exc

    thread = threading.Thread(target=train)
    thread.start()
    started.wait()
    flag.set()
    thread.join()
    assert "stopped" in outcome, outcome
    k = outcome["stopped"].steps
    assert k < cfg["steps"]
    again = model.init(1)
    if k:
        impl.local_train(again, None, model, x, labels, targets, dict(cfg, steps=k))
    np.testing.assert_array_equal(p, again)


def test_the_stop_flag_is_checked_at_the_kernels_face():
    model, x, y = make_data("softmax", n=8)
    p = model.init(0)
    cfg = kernels.train_config(lr=0.1, batch_size=4, epochs=1)
    with pytest.raises(KernelError, match="stop: need an edgefl.kernels.StopFlag, got ndarray"):
        kernels.local_train(model, p, x, y, cfg, stop=np.zeros(1, np.int32))
    with pytest.raises(KernelError, match="stop_after_steps: steps = -1"):
        kernels.StopFlag().stop_after_steps(-1)
    flag = kernels.StopFlag()
    flag.set()
    assert flag.is_set() and flag.wait(0)
    with pytest.raises(TrainingStopped, match="after 0 steps"):
        kernels.local_train(model, p, x, y, cfg, stop=flag)
    np.testing.assert_array_equal(p, model.init(0))


def test_mse_with_integer_labels_and_several_outputs_refuses_labels_out_of_range():
    # one-hot targets for integer labels: a label >= n_out was an IndexError from NumPy and a
    # negative one silently set the wrong column (-1: the last), training on wrong targets
    model = build_model(dict(name="linear", outputs=3, bias=False), (5,), 0)
    p = model.init(0)
    x = np.zeros((4, 5), np.float32)
    cfg = kernels.train_config(lr=0.1, batch_size=2, epochs=1)
    for bad in ([0, 1, 2, 3], [0, -1, 2, 1]):
        with pytest.raises(KernelError, match=r"y: labels span \[-?\d, \d\] but model linear "
                                              r"with 3 outputs takes 0\.\.2"):
            kernels.local_train(model, p, x, np.array(bad), cfg)
    _, t = kernels.labels_and_targets(model, np.array([0, 2, 1, 2]), 4)
    assert t.tolist() == [[1, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 1]]


@pytest.mark.parametrize("spec, shape", [
    ({"name": "mlp", "hidden": [64]}, (1, 8, 8)),
    ({"name": "softmax"}, (1, 28, 28)),
    ({"name": "cnn", "conv": [{"out": 16, "k": 3, "pad": 1, "pool": 2}], "fc": [32]}, (1, 28, 28)),
    ({"name": "cnn", "conv": [{"out": 32, "k": 3, "pad": 1}, {"out": 32, "k": 3, "pad": 1}]},
     (1, 12, 12)),
])
@pytest.mark.parametrize("batch_size", [32, 0])
def test_workspace_bytes_covers_what_a_local_round_allocates(spec, shape, batch_size):
    """A board's memory check counts kernels.workspace_bytes plus three copies of the
    parameters: that must cover the peak of what local_train allocates (traced, in a fresh
    thread so the core's per-thread workspace cache starts empty), and not overstate it more
    than a few times (a budget refusing runs it could train is no better)."""
    import tracemalloc

    model = build_model(spec, shape, 10)
    n = 300
    rng = np.random.default_rng(0)
    x = rng.random((n, *shape), dtype=np.float32)
    y = (np.arange(n) % 10).astype(np.int32)
    params = (rng.standard_normal(model.n_params) * 0.01).astype(np.float32)
    cfg = kernels.train_config(lr=0.01, batch_size=batch_size, epochs=1)
    peak = []

    def local_round():
        tracemalloc.start()
        try:
            kernels.local_train(model, params.copy(), x, y, cfg)
            peak.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()

    thread = threading.Thread(target=local_round)
    thread.start()
    thread.join()
    estimate = kernels.workspace_bytes(model, batch_size, n) + 12 * model.n_params
    assert peak[0] <= estimate <= 4 * peak[0], (peak[0], estimate)


def test_workspace_bytes_refuses_what_is_not_a_model():
    with pytest.raises(KernelError, match="not an edgefl Model"):
        kernels.workspace_bytes(object(), 32, 100)


@needs_core
def test_the_chunk_python_checks_against_is_the_c_cores():
    """The builder refuses a model whose max pool's argmax overflows over a chunk of
    models.KERNEL_CHUNK samples, and the NumPy twin evaluates in chunks of
    reference.EVAL_CHUNK, both for the C core's EF_MAX_CHUNK: a model either backend
    builds must run on the other. Kept in step here, not by hand."""
    from edgefl import models
    assert models.KERNEL_CHUNK == reference.EVAL_CHUNK == _core.MAX_CHUNK == _core.EVAL_CHUNK
