"""ONNX export and on-board inference (issue #5): onnxruntime's probabilities equal the C
forward pass's for every model kind, on random raw inputs and real test data; metadata;
int8 quantisation; `edgefl export` / `edgefl predict`; hot reload under load; bad input."""
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import onnx
import pytest

from edgefl import kernels
from edgefl.cli import main
from edgefl.data import load_dataset
from edgefl.data.datasets import FASHION_MNIST_DIR, standardisation
from edgefl.export import (
    IR_VERSION,
    OPSET,
    ExportError,
    export_checkpoint,
    export_onnx,
    load_run,
)
from edgefl.export.onnx import METADATA_KEYS, model_payload, raw_inputs
from edgefl.infer import (
    InputError,
    ModelFileError,
    Predictor,
    install_model,
    read_inputs,
)
from edgefl.io import atomic_write
from edgefl.models import OP_DENSE, build_model
from edgefl.runconfig import run_config_from_mapping
from edgefl.sim import simulate
from helpers import onnx_edgefl_never_emits, onnx_that_loads_but_cannot_run, usage_error

PROB_ATOL = 1e-5   # the parity bound of issue #5 item 2, on probabilities

# kind -> (model spec, per-sample input shape, classes; 0 = regression)
CASES = {
    "linear": (dict(name="linear"), (6,), 0),
    "linear-multi": (dict(name="linear", outputs=3, bias=False), (5,), 0),
    "linear-binary": (dict(name="linear"), (6,), 2),
    "logreg": (dict(name="logreg"), (7,), 2),
    "softmax": (dict(name="softmax"), (12,), 4),
    "svm-binary": (dict(name="svm", l2=0.1), (8,), 2),
    "svm-multi": (dict(name="svm", l2=0.1, bias=True), (8,), 4),
    "mlp": (dict(name="mlp", hidden=[16, 8]), (2, 5, 5), 3),
    "cnn": (dict(name="cnn", conv=[dict(out=4, k=3, pad=1, pool=2),
                                   dict(out=5, k=3, stride=2, pad=1),
                                   dict(out=6, k=2, stride=1, pool=2)], fc=[7]), (3, 11, 13), 5),
    "cnn-tabular": (dict(name="cnn", conv=[dict(out=4, k=1)], fc=[5]), (6,), 3),
    "cnn-mnist": ("cnn-mnist", (1, 28, 28), 10),
    "cnn-cifar": ("cnn-cifar", (3, 32, 32), 10),
    "lenet-cifar": ("lenet-cifar", (3, 32, 32), 10),
}


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------

def normalise(raw, mean, std):
    """The dataset loader's float32 arithmetic (data.datasets._normalise), any input rank."""
    shape = (-1,) + (1,) * (raw.ndim - 2)
    x = raw.astype(np.float32)
    x -= np.asarray(mean, np.float32).reshape(shape)
    x /= np.asarray(std, np.float32).reshape(shape)
    return x


def reference(model, params, x_norm, scores=None):
    """(probabilities, classes) from the C forward pass (kernels.forward, or its `scores`
    already computed), in float64."""
    if scores is None:
        scores = kernels.forward(model, params, np.ascontiguousarray(x_norm))
    s = scores.astype(np.float64)
    if model.n_out == 1:
        p1 = 1.0 / (1.0 + np.exp(-s[:, 0]))
        return np.stack([1.0 - p1, p1], axis=1), (s[:, 0] > 0).astype(np.int64)
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True), np.argmax(s, axis=1)


def sharpen(model, params, x_norm, target_std=3.0):
    """Scale the last dense layer so the scores spread over a few units: near-uniform
    probabilities from a fresh init would make the 1e-5 parity check weak."""
    row = [r for r in model.layers if r[0] == OP_DENSE][-1]
    n_w = int(row[1] * row[2] * row[3] * row[4])
    s = kernels.forward(model, params, x_norm)
    factor = np.float32(target_std / max(float(s.std()), 1e-6))
    params[int(row[10]):int(row[10]) + n_w] *= factor
    if row[11] >= 0:
        params[int(row[11]):int(row[11]) + int(row[4])] *= factor
    return params


def random_case(kind, n=12, seed=0):
    spec, shape, classes = CASES[kind]
    model = build_model(spec, shape, classes)
    rng = np.random.default_rng(seed)
    width = shape[0]
    if len(shape) == 3:      # images: pixels 0..255, per-channel statistics
        raw = rng.integers(0, 256, (n,) + shape).astype(np.float32)
        mean = rng.uniform(60, 140, width).astype(np.float32)
        std = rng.uniform(40, 80, width).astype(np.float32)
    else:                    # tabular: per-feature statistics
        mean = rng.normal(0, 3, width).astype(np.float32)
        std = rng.uniform(0.5, 4, width).astype(np.float32)
        raw = (rng.standard_normal((n, width)) * std + mean).astype(np.float32)
    params = model.init(seed)
    x = normalise(raw, mean, std)
    if classes:
        sharpen(model, params, x)
    return model, params, raw, x, mean, std


def check_parity(model, params, path, raw, x_norm):
    """onnxruntime on `raw` against the C forward pass on `x_norm`: the scores within 1e-5
    (relative and absolute) for every model, and for classifiers the probabilities within
    PROB_ATOL absolute and the same classes. The scores are compared for classifiers too,
    because saturated probabilities hide a wrong logit (a changed weight of a trained model
    can move a logit by several 1e-3 and its probabilities by less than 1e-5)."""
    predictor = Predictor(path, check_interval=None)
    got = predictor.scores(raw)
    want = kernels.forward(model, params, np.ascontiguousarray(x_norm))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if model.num_classes == 0:
        return
    classes, probs = predictor.predict(raw)
    want_p, want_c = reference(model, params, x_norm, scores=want)
    assert probs.shape == want_p.shape
    assert np.abs(probs - want_p).max() <= PROB_ATOL
    np.testing.assert_array_equal(classes, want_c)
    np.testing.assert_array_equal(np.argmax(probs, axis=1), np.argmax(want_p, axis=1))


def train(model, ds, epochs=2, seed=0, momentum=0.0, steps=0, lr=0.05):
    """A fresh init trained on ds.x_train, ds.y_train (labels, or float regression targets)."""
    params = model.init(seed)
    kernels.local_train(model, params, ds.x_train, ds.y_train,
                        kernels.train_config(lr=lr, momentum=momentum, epochs=epochs,
                                             steps=steps, batch_size=32, seed=seed),
                        momentum=np.zeros_like(params))
    return params


# ---------------------------------------------------------------------------------------
# graph and parity
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(CASES))
def test_random_inputs_match_the_c_forward_pass(kind, tmp_path):
    model, params, raw, x, mean, std = random_case(kind)
    path = tmp_path / f"{kind}.onnx"
    export_onnx(model, params, path, norm_mean=mean, norm_std=std)
    proto = onnx.load(path)
    onnx.checker.check_model(proto, full_check=True)
    assert proto.opset_import[0].version == OPSET and proto.ir_version == IR_VERSION
    assert [i.name for i in proto.graph.input] == ["input"]
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and [d.dim_value for d in dims[1:]] == list(model.input_shape)
    outputs = [o.name for o in proto.graph.output]
    assert outputs == (["scores", "probabilities"] if model.num_classes else ["scores"])
    check_parity(model, params, str(path), raw, x)
    check_parity(model, params, str(path), raw[:1], x[:1])     # the batch dimension is dynamic


def test_normalisation_in_the_graph_is_per_channel(tmp_path):
    """Swapping two channels' statistics must change the output: the graph really applies
    per-channel mean/std, not one scalar."""
    model, params, raw, x, mean, std = random_case("lenet-cifar", n=4)
    export_onnx(model, params, tmp_path / "a.onnx", norm_mean=mean, norm_std=std)
    export_onnx(model, params, tmp_path / "b.onnx", norm_mean=mean[::-1].copy(),
                norm_std=std[::-1].copy())
    a = Predictor(tmp_path / "a.onnx").scores(raw)
    b = Predictor(tmp_path / "b.onnx").scores(raw)
    np.testing.assert_allclose(a, kernels.forward(model, params, x), rtol=1e-5, atol=1e-5)
    assert np.abs(a - b).max() > 1e-3


def test_no_softmax_export_has_scores_only_and_the_predictor_computes_the_same_probabilities(
        tmp_path):
    for kind in ("softmax", "logreg"):
        model, params, raw, x, mean, std = random_case(kind)
        path = tmp_path / f"{kind}.onnx"
        export_onnx(model, params, path, norm_mean=mean, norm_std=std, softmax=False)
        assert [o.name for o in onnx.load(path).graph.output] == ["scores"]
        check_parity(model, params, str(path), raw, x)


DIGITS_KINDS = {
    "linear-binary": dict(name="linear"),
    "logreg": dict(name="logreg"),
    "svm-binary": dict(name="svm", l2=0.01),
    "softmax": dict(name="softmax"),
    "svm-multi": dict(name="svm", l2=0.01, bias=True),
    "mlp": dict(name="mlp", hidden=[32]),
    "cnn": dict(name="cnn", conv=[dict(out=6, k=3, pad=1, pool=2), dict(out=8, k=3, stride=2)],
                fc=[16]),
    "cnn-mnist": "cnn-mnist",
}


@pytest.fixture(scope="module")
def digits_even_odd():
    return load_dataset("digits", binary="even-odd")


def check_real_test_set(model, params, ds, raw, path):
    """Export `model` trained on `ds`, check onnxruntime against the C forward pass on the
    whole test set given as `raw` inputs (parity of probabilities and classes, and the
    accuracy through onnxruntime equal to kernels.evaluate's); returns that accuracy."""
    # the graph's Sub/Div reproduces the loader's normalisation bit for bit
    np.testing.assert_array_equal(normalise(raw, ds.norm_mean, ds.norm_std), ds.x_test)
    export_onnx(model, params, path, norm_mean=ds.norm_mean, norm_std=ds.norm_std,
                metadata={"class_names": list(ds.class_names)})
    check_parity(model, params, str(path), raw, ds.x_test)
    accuracy = kernels.evaluate(model, params, ds.x_test, ds.y_test)["accuracy"]
    classes, _ = Predictor(path).predict(raw)
    assert np.mean(classes == ds.y_test) == pytest.approx(accuracy, abs=1e-12)
    return accuracy


@pytest.mark.parametrize("kind", sorted(DIGITS_KINDS))
def test_real_digits_test_set_matches_the_c_forward_pass(kind, digits, digits_even_odd, tmp_path):
    spec = DIGITS_KINDS[kind]
    ds = digits_even_odd if kind.endswith("binary") or kind == "logreg" else digits
    model = build_model(spec, ds.input_shape, ds.num_classes)
    # cnn-mnist: a few steps are enough (and keep the NumPy-backend run short)
    params = train(model, ds, epochs=3, steps=40 if kind == "cnn-mnist" else 0,
                   momentum=0.9 if kind.startswith("cnn") else 0.0)
    accuracy = check_real_test_set(model, params, ds, raw_inputs(ds, ds.x_test),
                                   tmp_path / "m.onnx")
    assert accuracy > 0.6   # trained, so the probabilities are far from uniform


def digits_as_cifar(raw):
    """Raw digits (n, 1, 8, 8), values 0..16, as raw CIFAR-shaped images (n, 3, 32, 32) of
    whole pixel values 0..255: every digit pixel becomes a 4x4 block, and the three channels
    have statistics of their own (the digit; its half-contrast negative; a dimmer transpose),
    so the graph's per-channel normalisation matters."""
    p = np.rint(np.kron(raw[:, 0], np.ones((4, 4), np.float32)) * np.float32(255 / 16))
    channels = [p, 255 - np.rint(p / 2), np.rint(0.75 * p.transpose(0, 2, 1))]
    return np.ascontiguousarray(np.stack(channels, axis=1), dtype=np.float32)


@pytest.fixture(scope="module")
def digits_cifar(digits):
    """The digits split as 3x32x32 pixel images, normalised per channel with the training
    set's statistics as an image loader does (data.datasets.standardisation, _normalise)."""
    raw_train = digits_as_cifar(raw_inputs(digits, digits.x_train))
    raw_test = digits_as_cifar(raw_inputs(digits, digits.x_test))
    mean, std = standardisation(raw_train)
    assert np.ptp(mean) > 100 and np.ptp(std) > 40     # really per-channel statistics
    return SimpleNamespace(name="digits-as-cifar", input_shape=(3, 32, 32), num_classes=10,
                           class_names=digits.class_names, norm_mean=mean, norm_std=std,
                           x_train=normalise(raw_train, mean, std), y_train=digits.y_train,
                           x_test=normalise(raw_test, mean, std), y_test=digits.y_test,
                           raw_test=raw_test)


@pytest.mark.parametrize("kind", [pytest.param("cnn-cifar", marks=pytest.mark.slow),
                                  "lenet-cifar"])
def test_real_digits_as_cifar_images_match_the_c_forward_pass(kind, digits_cifar, tmp_path):
    """The CIFAR presets on real images: the 359 digits test images as 3x32x32 pixels."""
    ds = digits_cifar
    model = build_model(kind, ds.input_shape, ds.num_classes)
    # cnn-cifar (798k parameters): 40 steps, as for cnn-mnist; lenet-cifar: 3 epochs
    params = train(model, ds, epochs=3, steps=40 if kind == "cnn-cifar" else 0,
                   momentum=0.9, lr=0.02)
    path = tmp_path / "m.onnx"
    accuracy = check_real_test_set(model, params, ds, ds.raw_test, path)
    assert accuracy > 0.6
    _, probs = Predictor(path).predict(ds.raw_test)   # equal to the C core's, checked above
    assert probs.max(axis=1).mean() > 0.5   # trained: far from a fresh init's uniform 0.1


def regression_targets(ds, outputs):
    """Float targets from digits: the digit's value, then the mean of its normalised pixels
    and of its top two rows (so a 3-output linear model regresses three different things)."""
    def targets(x, y):
        n = len(x)
        columns = [y.astype(np.float32), x.reshape(n, -1).mean(axis=1),
                   x[:, 0, :2].reshape(n, -1).mean(axis=1)]
        t = np.stack(columns[:outputs], axis=1).astype(np.float32)
        return t[:, 0].copy() if outputs == 1 else t
    return targets(ds.x_train, ds.y_train), targets(ds.x_test, ds.y_test)


@pytest.mark.parametrize("outputs", [1, 3])
def test_real_digits_regression_outputs_match_the_c_forward_pass(outputs, digits, tmp_path):
    """linear with num_classes=0 (regression) on the real digits test set: the graph's
    `scores` equal the C forward pass within the parity bound, absolute."""
    y_train, y_test = regression_targets(digits, outputs)
    ds = SimpleNamespace(x_train=digits.x_train, y_train=y_train)
    model = build_model(dict(name="linear", outputs=outputs), digits.input_shape, 0)
    fresh = kernels.evaluate(model, model.init(0), digits.x_test, y_test)["loss"]
    params = train(model, ds, epochs=3, lr=0.01)
    trained = kernels.evaluate(model, params, digits.x_test, y_test)["loss"]
    assert trained < 0.25 * fresh                       # trained, not a fresh init
    raw = raw_inputs(digits, digits.x_test)
    np.testing.assert_array_equal(normalise(raw, digits.norm_mean, digits.norm_std),
                                  digits.x_test)
    path = tmp_path / "reg.onnx"
    export_onnx(model, params, path, norm_mean=digits.norm_mean, norm_std=digits.norm_std)
    proto = onnx.load(path)
    assert [o.name for o in proto.graph.output] == ["scores"]
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["task"] == "regression" and meta["decision"] == "none"
    check_parity(model, params, str(path), raw, digits.x_test)
    got = Predictor(path, check_interval=None).scores(raw)
    want = kernels.forward(model, params, digits.x_test)
    assert got.shape == want.shape == (len(raw), outputs)
    assert np.abs(got - want).max() <= PROB_ATOL
    assert np.ptp(want[:, 0]) > 5     # the predictions spread over the digits' 0..9


@pytest.mark.fashion_mnist
def test_real_fashion_mnist_test_set_matches_the_c_forward_pass(tmp_path):
    if not os.path.isdir(FASHION_MNIST_DIR):
        pytest.skip(f"{FASHION_MNIST_DIR} is absent: apt-get install dataset-fashion-mnist")
    ds = load_dataset("fashion-mnist", limit_train=2000)
    raw = raw_inputs(ds, ds.x_test)
    np.testing.assert_array_equal(normalise(raw, ds.norm_mean, ds.norm_std), ds.x_test)
    mlp = build_model(dict(name="mlp", hidden=[200, 200]), ds.input_shape, 10)
    params = train(mlp, ds, epochs=2)
    export_onnx(mlp, params, tmp_path / "mlp.onnx", norm_mean=ds.norm_mean, norm_std=ds.norm_std)
    check_parity(mlp, params, str(tmp_path / "mlp.onnx"), raw, ds.x_test)   # all 10,000
    cnn = build_model("cnn-mnist", ds.input_shape, 10)
    params = sharpen(cnn, cnn.init(1), ds.x_test[:32])
    export_onnx(cnn, params, tmp_path / "cnn.onnx", norm_mean=ds.norm_mean, norm_std=ds.norm_std)
    check_parity(cnn, params, str(tmp_path / "cnn.onnx"), raw[:64], ds.x_test[:64])


def test_metadata_names_the_model_the_run_and_the_layer_table(tmp_path, digits):
    model = build_model("softmax", digits.input_shape, 10)
    params = model.init(0)
    path = tmp_path / "m.onnx"
    export_onnx(model, params, path, norm_mean=digits.norm_mean, norm_std=digits.norm_std,
                metadata={"algorithm": "fedavg", "round": 7, "dataset": {"name": "digits"},
                          "class_names": list(digits.class_names), "accuracy": 0.91,
                          "input_range": [0, 16]})
    meta = {p.key: p.value for p in onnx.load(path).metadata_props}
    assert set(METADATA_KEYS) <= set(meta)
    assert meta["table_digest"] == model.table.digest
    assert meta["params_sha256"] == hashlib.sha256(params.tobytes()).hexdigest()
    assert meta["algorithm"] == "fedavg" and meta["round"] == "7"
    assert json.loads(meta["dataset"]) == {"name": "digits"}
    assert json.loads(meta["input_shape"]) == [1, 8, 8]
    assert json.loads(meta["class_names"]) == list(digits.class_names)
    assert float(meta["accuracy"]) == 0.91 and meta["decision"] == "argmax"
    assert json.loads(meta["norm_mean"]) == pytest.approx(digits.norm_mean.tolist())
    from edgefl import __version__
    assert meta["edgefl_version"] == __version__ and meta["quantization"] == "none"
    # the predictor reads them back through onnxruntime alone
    assert Predictor(path).metadata["table_digest"] == model.table.digest


def test_one_output_model_on_a_multiclass_dataset_names_label_one_against_the_rest(tmp_path,
                                                                                     digits):
    model = build_model(dict(name="linear"), digits.input_shape, 10)
    export_onnx(model, model.init(0), tmp_path / "m.onnx", norm_mean=digits.norm_mean,
                norm_std=digits.norm_std, metadata={"class_names": list(digits.class_names)})
    p = Predictor(tmp_path / "m.onnx")
    assert p.class_names == ("not 1", "1") and p.metadata["decision"] == "positive-score"


def test_export_refuses_params_that_do_not_fit_or_are_not_finite(tmp_path):
    model = build_model("softmax", (1, 8, 8), 10)
    with pytest.raises(ExportError, match=r"650 parameters \(layer table [0-9a-f]{12}\)"):
        export_onnx(model, np.zeros(649, np.float32), tmp_path / "m.onnx", norm_mean=[0],
                    norm_std=[1])
    params = model.init(0)
    params[700 - 100] = np.nan
    with pytest.raises(ExportError, match=r"layer 'fc1.weight' has non-finite values"):
        export_onnx(model, params, tmp_path / "m.onnx", norm_mean=[0], norm_std=[1])
    with pytest.raises(ExportError, match=r"norm_mean: 3 values for input shape \(1, 8, 8\)"):
        export_onnx(model, model.init(0), tmp_path / "m.onnx", norm_mean=[0, 0, 0], norm_std=[1])
    assert not (tmp_path / "m.onnx").exists()


# ---------------------------------------------------------------------------------------
# runs, checkpoints, quantisation, CLI
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    config = run_config_from_mapping({
        "dataset": {"name": "digits"},
        "partition": {"name": "iid", "clients": 4},
        "model": {"name": "mlp", "hidden": [32]},
        "strategy": {"name": "fedavg"},
        "train": {"lr": 0.1, "batch_size": 32, "epochs": 2},
        "rounds": 4, "clients_per_round": 4, "seed": 0})
    summary = simulate(config, out, workers=1, progress=False)
    return out, summary


def test_export_of_a_run_records_the_run_and_matches_its_accuracy(run_dir, tmp_path):
    out, summary = run_dir
    report = export_checkpoint(out, tmp_path / "m.onnx")
    for key in ("quantization", "quantization_mode", "quantization_method"):
        assert report[key] == Predictor(tmp_path / "m.onnx").metadata[key] == "none"
    assert report["accuracy_fp32"] == pytest.approx(summary["final_accuracy"], abs=1e-12)
    assert report["test_samples"] == 359 and report["round"] == 4
    meta = Predictor(tmp_path / "m.onnx").metadata
    assert meta["algorithm"] == "fedavg" and meta["round"] == "4"
    assert meta["accuracy_source"] == "onnxruntime:359"
    assert float(meta["accuracy"]) == pytest.approx(summary["final_accuracy"])
    assert json.loads(meta["dataset"])["name"] == "digits"
    assert json.loads(meta["input_range"]) == [0, 16]


def test_int8_export_reports_the_accuracy_change(run_dir, tmp_path, monkeypatch):
    out, _ = run_dir
    target = tmp_path / "q.onnx"
    target.write_bytes(b"the model a board serves now")
    import edgefl.export.onnx as exporter
    replaced = []

    def spy(src, dst):   # `out` is replaced once, by the finished file
        replaced.append(open(dst, "rb").read() == b"the model a board serves now")
        os.replace(src, dst)

    monkeypatch.setattr(exporter, "replace_atomic", spy)
    report = export_checkpoint(out, target, quantize="int8")
    assert replaced == [True]
    fp32, int8 = report["accuracy_fp32"], report["accuracy_int8"]
    assert fp32 > 0.8 and abs(int8 - fp32) < 0.03
    assert report["bytes"] < report["bytes_fp32"]
    proto = onnx.load(tmp_path / "q.onnx")
    onnx.checker.check_model(proto, full_check=True)
    ops = {n.op_type for n in proto.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "Gemm", "Softmax"} <= ops
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["quantization"] == "int8-static-qdq" and float(meta["accuracy"]) == int8
    # the report names the quantisation with the file's own keys and values
    keys = ("quantization", "quantization_mode", "quantization_method")
    assert {k: report[k] for k in keys} == {k: meta[k] for k in keys} == {
        "quantization": "int8-static-qdq", "quantization_mode": "int8",
        "quantization_method": "static-qdq"}
    assert meta["calibration_samples"] == "512"
    assert not [f for f in os.listdir(tmp_path) if f != "q.onnx"]   # no temporaries left


def test_cli_export_and_predict_on_npy_csv_and_an_image(run_dir, tmp_path, capsys, digits):
    out, summary = run_dir
    model_path = str(tmp_path / "m.onnx")
    assert main(["export", str(out), "--out", model_path]) == 0
    printed = capsys.readouterr().out
    assert "exported mlp" in printed and f"fp32 {summary['final_accuracy']:.4f}" in printed
    raw = raw_inputs(digits, digits.x_test[:5])
    np.save(tmp_path / "x.npy", raw)
    np.savetxt(tmp_path / "x.csv", raw.reshape(5, -1), delimiter=",", fmt="%g",
               header=",".join(f"p{i}" for i in range(64)), comments="")
    want, probs = Predictor(model_path).predict(raw)
    for name in ("x.npy", "x.csv"):
        assert main(["predict", model_path, "--input", str(tmp_path / name), "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["classes"] == want.tolist()
        np.testing.assert_allclose(result["probabilities"], probs, atol=1e-7)
    assert main(["predict", model_path, "--input", str(tmp_path / "x.npy")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 and lines[0].startswith(f"0: {want[0]} (class {want[0]}, p=")

    from PIL import Image  # an image file: grayscale, 4x larger, pixels 0..255
    Image.fromarray(np.rint(raw[0, 0] * 255 / 16).astype(np.uint8)).resize(
        (32, 32), Image.NEAREST).save(tmp_path / "digit.png")
    x = read_inputs(tmp_path / "digit.png", (1, 8, 8), [0, 16])
    assert x.shape == (1, 1, 8, 8) and x.max() <= 16.0
    np.testing.assert_allclose(x[0], raw[0], atol=16 / 255 / 2 + 1e-5)   # 8-bit rounding
    assert main(["predict", model_path, "--input", str(tmp_path / "digit.png"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["classes"] == \
        Predictor(model_path).predict(x)[0].tolist()


def test_cli_predict_from_dataset_takes_raw_test_samples_of_the_models_data_set(
        run_dir, tmp_path, capsys, digits):
    out, _ = run_dir
    model_path = str(tmp_path / "m.onnx")
    assert main(["export", str(out), "--out", model_path]) == 0
    capsys.readouterr()
    want, probs = Predictor(model_path).predict(raw_inputs(digits, digits.x_test[:3]))
    for named in ([], ["digits"]):         # the model's own data set, or one named
        assert main(["predict", model_path, "--from-dataset", *named, "--limit", "3",
                     "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["input"] == "digits test samples 0..2"
        assert result["classes"] == want.tolist()
        assert result["labels"] == digits.y_test[:3].tolist()
        np.testing.assert_allclose(result["probabilities"], probs, atol=1e-7)
    assert main(["predict", model_path, "--from-dataset"]) == 0     # 10 by default
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 10 and lines[0].endswith(f"(true: {digits.y_test[0]})")

    assert main(["predict", model_path, "--from-dataset", "synthetic", "--limit", "2"]) == 1
    assert "its samples have shape" in capsys.readouterr().err
    assert main(["predict", model_path, "--input", "x.npy", "--limit", "2"]) == 1
    assert "a --input file is read whole" in capsys.readouterr().err
    model, params, raw, x, mean, std = random_case("softmax", n=2)
    export_onnx(model, params, tmp_path / "bare.onnx", norm_mean=mean, norm_std=std)
    assert main(["predict", str(tmp_path / "bare.onnx"), "--from-dataset"]) == 1
    assert capsys.readouterr().err == (
        "edgefl predict: error: --from-dataset: the model does not name the data set it was "
        "trained on; name one: --from-dataset NAME\n")


def test_cli_export_writes_next_to_the_checkpoint_by_default(run_dir, capsys):
    out, _ = run_dir
    target = out / "model.onnx"
    if target.exists():
        target.unlink()
    assert main(["export", str(out), "--no-softmax"]) == 0
    assert f"to {target}" in capsys.readouterr().out
    assert [o.name for o in onnx.load(target).graph.output] == ["scores"]


@pytest.mark.parametrize("option, value", [("--top", "-1"), ("--top", "0"), ("--limit", "0"),
                                           ("--limit", "-3"), ("--threads", "-1"),
                                           ("--threads", "0")])
def test_cli_predict_refuses_a_count_below_one_naming_the_option(tmp_path, capsys, option,
                                                                   value):
    # --top -1 and --top 0 printed every sample with one class (rc 0), as if asked for it;
    # a count below one is a mistyped command line, refused before the model is loaded;
    # --threads -1 reached Predictor's ValueError (0, onnxruntime's "all", is not offered:
    # a board's threads are its device profile's infer.threads, at least 1)
    model, params, raw, x, mean, std = random_case("logreg", n=4)
    path = str(tmp_path / "m.onnx")
    export_onnx(model, params, path, norm_mean=mean, norm_std=std)
    assert usage_error(["predict", path, "--from-dataset", "digits", option, value],
                       capsys) == (f"edgefl predict: error: argument {option}: need a whole "
                                   f"number >= 1, got {value}")

def test_cli_predict_prints_values_for_a_regression_model(tmp_path, capsys):
    model, params, raw, x, mean, std = random_case("linear-multi", n=4)
    path = str(tmp_path / "reg.onnx")
    export_onnx(model, params, path, norm_mean=mean, norm_std=std)
    assert Predictor(path).metadata["decision"] == "none"
    with pytest.raises(ModelFileError, match=r"regression model .* use Predictor.scores"):
        Predictor(path).predict(raw)
    np.save(tmp_path / "x.npy", raw)
    assert main(["predict", path, "--input", str(tmp_path / "x.npy"), "--json"]) == 0
    values = json.loads(capsys.readouterr().out)["values"]
    np.testing.assert_allclose(values, kernels.forward(model, params, x), rtol=1e-5, atol=1e-5)


def test_cli_predict_into_a_closed_pipe_ends_quietly(tmp_path):
    """`edgefl predict ... | head -1`: the reader goes after one line. The output (~150 kB)
    is larger than a pipe's buffer, so predict is still writing when the pipe closes; it
    must end with no message (no "error: [Errno 32] Broken pipe", no "Exception ignored")
    and 141, the status of a program stopped by SIGPIPE."""
    model, params, raw, x, mean, std = random_case("softmax", n=2500)
    path = str(tmp_path / "m.onnx")
    export_onnx(model, params, path, norm_mean=mean, norm_std=std)
    np.save(tmp_path / "x.npy", raw)
    proc = subprocess.Popen([sys.executable, "-m", "edgefl.cli", "predict", path,
                             "--input", str(tmp_path / "x.npy")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=60) == 141, err
    assert first.startswith(b"0: ") and err == b""


def test_cli_export_quantize_prints_both_accuracies(run_dir, tmp_path, capsys):
    out, _ = run_dir
    assert main(["export", str(out / "model.npz"), "--out", str(tmp_path / "q.onnx"),
                 "--quantize", "int8"]) == 0
    printed = capsys.readouterr().out
    assert "int8" in printed and "change" in printed and "fp32" in printed


def test_cli_export_json_reports_the_quantization_keys_of_the_file(run_dir, tmp_path, capsys):
    out, _ = run_dir
    target = tmp_path / "q.onnx"
    assert main(["export", str(out), "--out", str(target), "--quantize", "int8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    meta = Predictor(target).metadata
    for key in ("quantization", "quantization_mode", "quantization_method"):
        assert report[key] == meta[key]
    assert report["quantization_mode"] == "int8"


def test_a_failed_final_export_leaves_the_other_outputs_and_names_the_cause(tmp_path, capsys,
                                                                              caplog):
    """A directory where model.onnx goes (a real failure of the atomic replace): `edgefl
    simulate` still writes summary.json, model.npz, metrics.jsonl and curves.png, exits 0,
    and logs an error naming the file and the cause."""
    out = tmp_path / "run"
    (out / "model.onnx").mkdir(parents=True)
    with caplog.at_level(logging.ERROR, logger="edgefl.runs.outputs"):
        assert main(["simulate", "quickstart", "--out", str(out), "--quiet", "--force",
                     "--set", "rounds=2", "--set", "partition.clients=4",
                     "--set", "clients_per_round=4"]) == 0
    printed = capsys.readouterr()
    assert "final accuracy" in printed.out and "edgefl simulate: error" not in printed.err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2 and "onnx_exports" not in summary
    assert load_run(out).round == 2                                  # model.npz
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "model.onnx").is_dir()                             # left alone
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]    # no temporaries left
    final = [r.getMessage() for r in caplog.records if "final ONNX export" in r.getMessage()]
    assert len(final) == 1, caplog.text
    assert f"{out / 'model.onnx'} failed (IsADirectoryError" in final[0]
    assert f"retry with `edgefl export {out}`" in final[0]


def test_the_end_of_run_export_keeps_the_runs_export_settings(tmp_path, capsys):
    """When the final round's export did not happen, write_outputs exports model.onnx from
    model.npz: with the run's export policy (no softmax output, int8), not the defaults."""
    from edgefl.export import ExportPolicy
    from edgefl.runs.outputs import export_final_onnx as _export_onnx
    out = tmp_path / "run"
    assert main(["simulate", "quickstart", "--out", str(out), "--quiet",
                 "--set", "rounds=2", "--set", "partition.clients=4",
                 "--set", "clients_per_round=4"]) == 0
    (out / "model.onnx").unlink()
    _export_onnx(str(out), None, ExportPolicy(softmax=False, quantize="int8"))
    proto = onnx.load(str(out / "model.onnx"))
    assert [o.name for o in proto.graph.output] == ["scores"]
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["quantization_mode"] == "int8"


def tamper_checkpoint(src, dst, **changes):
    with np.load(src, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays.update(changes)
    with open(dst, "wb") as f:
        np.savez(f, **arrays)


def test_checkpoint_whose_table_does_not_match_its_model_config_is_refused(run_dir, tmp_path,
                                                                             capsys):
    out, _ = run_dir
    bad = tmp_path / "model.npz"
    spec = json.dumps({"name": "mlp", "hidden": [33]})
    tamper_checkpoint(out / "model.npz", bad, model_spec=np.array(spec))
    right = build_model(dict(name="mlp", hidden=[32]), (1, 8, 8), 10).table.digest[:12]
    wrong = build_model(dict(name="mlp", hidden=[33]), (1, 8, 8), 10).table.digest[:12]
    with pytest.raises(ExportError, match=rf"{bad}: the checkpoint's layer table \(digest "
                                          rf"{right}.*builds \(digest {wrong}"):
        load_run(bad)
    assert main(["export", str(bad), "--out", str(tmp_path / "m.onnx")]) == 1
    assert f"digest {right}" in capsys.readouterr().err
    assert not (tmp_path / "m.onnx").exists()


def test_an_output_in_a_missing_directory_is_refused_naming_it(run_dir, tmp_path, capsys):
    # the file asked for and its directory, not the temporaries the export builds beside it
    out, _ = run_dir
    target = tmp_path / "absent" / "m.onnx"
    assert main(["export", str(out), "--out", str(target)]) == 1
    err = capsys.readouterr().err
    assert f"export: error: {target}: no directory {tmp_path / 'absent'} to write it in" in err
    assert ".tmp" not in err
    assert not (tmp_path / "absent").exists()


def test_corrupt_or_missing_checkpoints_name_the_file(run_dir, tmp_path):
    out, _ = run_dir
    data = (out / "model.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[:len(data) // 2])
    with pytest.raises(ExportError, match=r"cut.npz: not a readable edgefl checkpoint"):
        load_run(tmp_path / "cut.npz")
    with pytest.raises(ExportError, match=r"run directory .* has no model.npz"):
        load_run(tmp_path)
    tamper_checkpoint(out / "model.npz", tmp_path / "short.npz",
                      params=np.zeros(10, np.float32))
    with pytest.raises(ExportError, match=r"short.npz: params is float32 \(10,\)"):
        load_run(tmp_path / "short.npz")


def test_quantize_without_data_says_why(run_dir, tmp_path):
    out, _ = run_dir
    lone = tmp_path / "lone"
    lone.mkdir()
    with np.load(out / "model.npz", allow_pickle=False) as ck:   # no summary.json and a
        arrays = {k: ck[k] for k in ck.files if k != "dataset"}   # checkpoint of old, without
    np.savez(lone / "model.npz", **arrays)                        # its dataset section
    with pytest.raises(ExportError, match=r"needs calibration and test data, but the "
                                          r"checkpoint does not name its dataset"):
        export_checkpoint(lone, tmp_path / "q.onnx", quantize="int8")
    report = export_checkpoint(lone, tmp_path / "f.onnx")   # fp32 needs no data
    assert report["accuracy_fp32"] is None and "does not name its dataset" in report["note"]


# ---------------------------------------------------------------------------------------
# Predictor: bad input, bad files, hot reload
# ---------------------------------------------------------------------------------------

@pytest.fixture
def two_models(tmp_path, digits):
    """Two softmax models on digits that disagree, serialised, and raw inputs."""
    model = build_model("softmax", digits.input_shape, 10)
    raw = raw_inputs(digits, digits.x_test[:8])
    blobs = []
    for seed in (1, 2):
        params = sharpen(model, model.init(seed), digits.x_test[:8], 4.0)
        export_onnx(model, params, tmp_path / f"{seed}.onnx", norm_mean=digits.norm_mean,
                    norm_std=digits.norm_std, metadata={"round": seed})
        blobs.append((tmp_path / f"{seed}.onnx").read_bytes())
    expected = [Predictor(tmp_path / f"{s}.onnx").predict(raw)[1] for s in (1, 2)]
    assert np.abs(expected[0] - expected[1]).max() > 0.05
    return blobs, raw, expected


def test_wrong_input_shapes_and_values_are_named(two_models, tmp_path):
    blobs, raw, _ = two_models
    atomic_write(tmp_path / "m.onnx", blobs[0])
    p = Predictor(tmp_path / "m.onnx")
    assert p.predict(raw[0])[0].shape == (1,)                 # one sample
    assert p.predict(raw.reshape(8, 64))[0].shape == (8,)     # flattened
    with pytest.raises(InputError, match=r"shape \(8, 1, 8, 9\) does not fit model input "
                                         r"\(1, 8, 8\).*expected \(n, 1, 8, 8\)"):
        p.predict(np.zeros((8, 1, 8, 9), np.float32))
    with pytest.raises(InputError, match=r"shape \(3, 63\)"):
        p.predict(np.zeros((3, 63)))
    bad = raw.copy()
    bad[5, 0, 2, 2] = np.nan
    with pytest.raises(InputError, match=r"sample 5 has non-finite values"):
        p.predict(bad)
    with pytest.raises(InputError, match=r"dtype <U1 is not numeric"):
        p.predict(np.full((1, 1, 8, 8), "a"))
    # an input path that is wrong says how: missing, or a directory
    with pytest.raises(InputError, match=rf"{tmp_path / 'none.npy'}: input file does not exist"):
        read_inputs(tmp_path / "none.npy", (1, 8, 8))
    with pytest.raises(InputError, match=rf"{tmp_path}: a directory; give one input file"):
        read_inputs(tmp_path, (1, 8, 8))


@pytest.mark.parametrize("dtype", ["complex64", "complex128", "m8[s]"])
def test_complex_or_time_inputs_are_refused_not_cast(dtype, two_models, tmp_path):
    """A complex array passed numpy's "number" check and was cast to float32, dropping the
    imaginary part; timedelta64 was taken as numbers of its unit. Both are refused, naming
    the dtype, and the model keeps serving."""
    blobs, raw, (p1, _) = two_models
    atomic_write(tmp_path / "m.onnx", blobs[0])
    p = Predictor(tmp_path / "m.onnx")
    with pytest.raises(InputError, match=rf"input: dtype {re.escape(str(np.dtype(dtype)))} is "
                                         r"not numeric \(need real numbers: bool, integer or "
                                         r"float\); expected \(n, 1, 8, 8\)"):
        p.predict(raw.astype(np.int64).astype(dtype))
    np.testing.assert_array_equal(p.predict(raw)[1], p1)


def test_a_finite_value_beyond_float32_is_named_as_such(two_models, tmp_path):
    """1e39 is a finite float64 that float32 cannot hold: the cast made it inf and the
    error said the sample "has non-finite values", which the caller's data did not."""
    blobs, raw, (p1, _) = two_models
    atomic_write(tmp_path / "m.onnx", blobs[0])
    p = Predictor(tmp_path / "m.onnx")
    bad = raw.astype(np.float64)
    bad[3, 0, 1, 1] = -1e39
    with pytest.raises(InputError, match=r"input: sample 3 has values beyond float32 "
                                         r"\(largest magnitude 1e\+39"):
        p.predict(bad)
    bad[3, 0, 1, 1] = np.inf
    with pytest.raises(InputError, match=r"sample 3 has non-finite values"):
        p.predict(bad)
    np.testing.assert_array_equal(p.predict(raw)[1], p1)


def test_a_large_batch_runs_in_bounded_memory(tmp_path):
    """`edgefl serve` takes any batch that fits infer.max_request_bytes (16 MiB: 5,349
    cnn-mnist samples), and onnxruntime held every activation of the whole batch at once
    (cnn-mnist at that batch: 1.08 GB resident, on boards with 0.5-4 GB). The Predictor runs
    a large batch in slices of RUN_BATCH samples through the one model. Measured in a
    process of its own: a model of 400 KB of activations a sample grew the peak resident
    memory by 408 MB for 1,024 samples; in slices it grows by what one slice needs, and the
    answer equals the one-slice-at-a-time answer."""
    script = f"""
import resource, sys, numpy as np
from edgefl.models import build_model
from edgefl.export import export_onnx
from edgefl.infer import Predictor
m = build_model({{"name": "cnn", "conv": [{{"out": 64, "k": 1}}], "fc": []}}, (1, 28, 28), 10)
export_onnx(m, m.init(0), {str(tmp_path / "wide.onnx")!r}, norm_mean=[0.0], norm_std=[1.0])
p = Predictor({str(tmp_path / "wide.onnx")!r}, check_interval=None)
x = np.random.default_rng(0).integers(0, 256, (1025, 1, 28, 28)).astype(np.float32)
parts = [p.predict(x[i:i + 25])[1] for i in range(0, 1025, 25)]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
classes, probs = p.predict(x)
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
assert probs.shape == (1025, 10) and classes.shape == (1025,)
np.testing.assert_allclose(probs, np.concatenate(parts), rtol=0, atol=1e-6)
print("grown_mb", grown)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    grown = int(done.stdout.split("grown_mb")[1])
    assert grown < 150, f"peak resident memory grew by {grown} MB for 1,025 samples"


@pytest.mark.parametrize("content, problem", [
    (b"\xff\xfe1,2\n", r"not UTF-8 text \(byte 0xff at offset 0\)"),
    (b"a,b\n1,2\n3,x\n", r"line 3, column 'b': 'x' is not a number"),
    (b"1,2\n3\n", r"line 2 has 1 columns, expected 2"),
    (b"a,b\n", r"the file has a header but no data rows"),
    (b"\n\n", r"the file is empty"),
])
def test_a_bad_csv_input_is_refused_naming_the_file_and_line(tmp_path, content, problem):
    """predict --input x.csv reads its file as a CSV data set is read (one reader): a bad
    file is an InputError that names it, the line and the column."""
    path = tmp_path / "x.csv"
    path.write_bytes(content)
    with pytest.raises(InputError, match=re.escape(str(path)) + ": " + problem):
        read_inputs(path, (2,))


def test_a_csv_input_with_a_header_is_read_as_float32(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("a,b\n1, 2.5\n\n3,4\n")
    x = read_inputs(path, (2,))
    assert x.dtype == np.float32 and x.tolist() == [[1.0, 2.5], [3.0, 4.0]]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_model_files_are_refused_naming_the_file(damage, two_models, tmp_path, capsys):
    blobs, raw, _ = two_models
    data = {"truncated": blobs[0][:len(blobs[0]) * 2 // 3], "garbage": os.urandom(3000),
            "empty": b""}[damage]
    path = tmp_path / "bad.onnx"
    path.write_bytes(data)
    with pytest.raises(ModelFileError, match=rf"{path}: (not a loadable ONNX model|empty file)"):
        Predictor(path)
    np.save(tmp_path / "x.npy", raw)
    assert main(["predict", str(path), "--input", str(tmp_path / "x.npy")]) == 1
    assert str(path) in capsys.readouterr().err
    with pytest.raises(ModelFileError, match=r"does not exist"):
        Predictor(tmp_path / "missing.onnx")


def test_a_half_written_or_incompatible_file_is_never_served(two_models, tmp_path, caplog):
    blobs, raw, (p1, p2) = two_models
    path = tmp_path / "m.onnx"
    atomic_write(path, blobs[0])
    pred = Predictor(path, check_interval=0)
    with open(path, "wb") as f:        # a non-atomic writer, caught half way
        f.write(blobs[1][:len(blobs[1]) // 2])
    with caplog.at_level(logging.WARNING, logger="edgefl.infer"):
        assert pred.reload() is False
        np.testing.assert_array_equal(pred.predict(raw)[1], p1)
    assert f"{path}: not a loadable ONNX model" in pred.last_error
    assert "still serving the previous model" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgefl.infer"):
        for _ in range(5):             # the same broken version is logged once, not per call
            pred.predict(raw)
    assert caplog.text.count("not a loadable") == 0
    atomic_write(path, blobs[1])       # the writer finishes properly
    assert pred.reload() is True
    np.testing.assert_allclose(pred.predict(raw)[1], p2, atol=1e-7)

    other = build_model("softmax", (64,), 10)   # a different input shape
    export_onnx(other, other.init(0), tmp_path / "o.onnx", norm_mean=[0], norm_std=[1])
    atomic_write(path, (tmp_path / "o.onnx").read_bytes())
    assert pred.reload() is False and "takes input (64,), the served one (1, 8, 8)" in \
        pred.last_error
    np.testing.assert_allclose(pred.predict(raw)[1], p2, atol=1e-7)
    os.unlink(path)                    # the file vanishes: keep serving
    assert pred.reload() is False and "cannot stat" in pred.last_error
    np.testing.assert_allclose(pred.predict(raw)[1], p2, atol=1e-7)


def test_a_model_that_loads_but_cannot_run_is_never_served_nor_installed(two_models,
                                                                         tmp_path):
    """onnxruntime builds a session from a graph whose Reshape does not fit the declared
    input; only running it fails. Such a file was loaded, swapped in over a working model
    and installed from MQTT, and then every prediction failed. One zero sample is now run at
    load: the file is refused naming it and onnxruntime's error, and the model served (or
    installed) before stays."""
    blobs, raw, (p1, _) = two_models
    broken = onnx_that_loads_but_cannot_run()
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(broken)
    with pytest.raises(ModelFileError, match=rf"{re.escape(str(bad))}: loads but does not run"
                                             rf".*cannot be reshaped"):
        Predictor(bad)

    path = tmp_path / "m.onnx"
    atomic_write(path, blobs[0])
    pred = Predictor(path, check_interval=0)
    atomic_write(path, broken)
    assert pred.reload() is False
    assert pred.last_error.startswith(f"{path}: loads but does not run"), pred.last_error
    assert "cannot be reshaped" in pred.last_error
    assert "still serving the previous model" in pred.last_error
    np.testing.assert_array_equal(pred.predict(raw)[1], p1)

    state = tmp_path / "state"
    installed = install_model(blobs[0], state)
    with pytest.raises(ModelFileError, match=r"\(received\): loads but does not run.*"
                                             r"cannot be reshaped"):
        install_model(broken, state, sha256=hashlib.sha256(broken).hexdigest())
    with open(installed, "rb") as f:
        assert f.read() == blobs[0]                            # untouched
    assert sorted(os.listdir(state)) == ["model.onnx"]         # no temporaries left


def test_a_change_hidden_from_stat_is_caught_while_the_file_is_young(two_models, tmp_path,
                                                                       digits):
    """File timestamps tick coarsely and inode numbers are reused, so A -> B -> A' within
    one tick can leave (inode, size, mtime) as they were for A. Simulated exactly: A'
    (same size) written over A in place, then A's mtime restored. The predictor must still
    notice, by content, while the file is younger than the racy window."""
    blobs, raw, (p1, _) = two_models
    path = tmp_path / "m.onnx"
    atomic_write(path, blobs[0])
    pred = Predictor(path, check_interval=0)
    model = build_model("softmax", digits.input_shape, 10)
    params = sharpen(model, model.init(3), digits.x_test[:8], 4.0)
    export_onnx(model, params, tmp_path / "3.onnx", norm_mean=digits.norm_mean,
                norm_std=digits.norm_std, metadata={"round": 1})
    third = (tmp_path / "3.onnx").read_bytes()
    assert len(third) == len(blobs[0])
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.write(third)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == \
        (before.st_ino, before.st_size, before.st_mtime_ns)
    time.sleep(0.06)   # RACY_RECHECK_S: content checks are rate-limited
    assert pred.reload() is True
    assert pred.sha256 == hashlib.sha256(third).hexdigest()
    assert not np.allclose(pred.predict(raw)[1], p1, atol=1e-3)


def test_hot_swap_under_load_never_fails_a_prediction(two_models, tmp_path):
    blobs, raw, expected = two_models
    path = tmp_path / "m.onnx"
    atomic_write(path, blobs[0])
    pred = Predictor(path, threads=1, check_interval=0)
    stop = threading.Event()
    errors, seen = [], [[] for _ in range(4)]

    def predict_loop(log):
        while not stop.is_set():
            try:
                _, probs = pred.predict(raw)
            except Exception as exc:     # noqa: BLE001 (any failure is the test's failure)
                errors.append(repr(exc))
                return
            which = [i for i, e in enumerate(expected) if np.abs(probs - e).max() < 1e-6]
            if len(which) != 1:
                errors.append(f"a prediction matches neither model: {probs[0]}")
                return
            log.append(which[0])

    threads = [threading.Thread(target=predict_loop, args=(log,)) for log in seen]
    for t in threads:
        t.start()
    try:
        for i in range(1, 10):           # B, A, B, ... ending on B
            time.sleep(0.04)
            atomic_write(path, blobs[i % 2])
        time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    flat = [w for log in seen for w in log]
    assert len(flat) > 100 and pred.reloads >= 2
    switches = sum(a != b for log in seen for a, b in zip(log, log[1:]))
    assert switches >= 4                 # the threads followed the swaps, both ways
    assert all(log[-1] == 1 for log in seen)   # and all ended on the last model written
    assert pred.metadata["round"] == "2"


# ---------------------------------------------------------------------------------------
# the MQTT hook: payload out, atomic install in
# ---------------------------------------------------------------------------------------

def test_payload_round_trip_and_install_refuses_damaged_bytes(two_models, tmp_path):
    blobs, raw, (p1, p2) = two_models
    atomic_write(tmp_path / "export.onnx", blobs[1])
    data, meta = model_payload(tmp_path / "export.onnx")
    assert data == blobs[1] and meta["sha256"] == hashlib.sha256(data).hexdigest()
    assert meta["round"] == "2" and int(meta["bytes"]) == len(data)
    state = tmp_path / "state"
    installed = install_model(blobs[0], state)           # a board's current model
    pred = Predictor(installed, check_interval=0)
    with pytest.raises(ModelFileError, match=r"sha256 .* the sender announced"):
        install_model(data[:-10] + b"0123456789", state, sha256=meta["sha256"])
    with pytest.raises(ModelFileError, match=r"\(received\): not a loadable ONNX model"):
        install_model(data[:len(data) // 2], state)
    np.testing.assert_array_equal(pred.predict(raw)[1], p1)   # untouched
    assert install_model(data, state, sha256=meta["sha256"]) == installed
    assert pred.reload() is True
    np.testing.assert_allclose(pred.predict(raw)[1], p2, atol=1e-7)
    assert sorted(os.listdir(state)) == ["model.onnx"]        # no temporaries left


@pytest.mark.parametrize("kind, refusal", [
    ("external", r"initializer 'weight' keeps its data in an external file \('secret\.bin'\)"),
    ("contrib", r"node 2 \('com\.microsoft' Gelu\) is an op edgefl's exporter never writes"),
    ("op", r"node 2 \(Tanh\) is an op edgefl's exporter never writes"),
    ("function", r"defines 1 model-local function\(s\) \(custom\.fn Squash\)"),
])
def test_a_model_edgefl_never_exports_is_refused_by_name_before_onnxruntime_loads_it(
        kind, refusal, two_models, tmp_path, monkeypatch):
    """onnxruntime builds and runs what an ONNX file holds: weights read from another file
    (external data: a model loaded from bytes resolves it against the working directory,
    so a delivered model could read what lies in the client's or the service's directory
    into its weights), onnxruntime's contrib ops, any standard op, model-local functions.
    Such files were served from disk and installed from MQTT. The file is now checked
    against what edgefl's exporter writes before onnxruntime sees it: refused naming the
    initializer, op or function, nothing installed, the model served before kept."""
    blobs, raw, (p1, _) = two_models
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.bin").write_bytes(os.urandom(4 * 640))
    data = onnx_edgefl_never_emits(kind)
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(data)
    with pytest.raises(ModelFileError, match=re.escape(str(bad)) + ": " + refusal):
        Predictor(bad)

    path = tmp_path / "m.onnx"
    atomic_write(path, blobs[0])
    pred = Predictor(path, check_interval=0)
    atomic_write(path, data)
    assert pred.reload() is False and re.search(refusal, pred.last_error), pred.last_error
    np.testing.assert_array_equal(pred.predict(raw)[1], p1)          # the model before

    state = tmp_path / "state"
    installed = install_model(blobs[0], state)
    with pytest.raises(ModelFileError, match=r"\(received\): " + refusal):
        install_model(data, state, sha256=hashlib.sha256(data).hexdigest())
    assert installed.endswith("model.onnx") and open(installed, "rb").read() == blobs[0]
    assert sorted(os.listdir(state)) == ["model.onnx"]


def test_a_model_file_beyond_the_size_limit_is_refused_before_it_is_read(two_models, tmp_path,
                                                                        monkeypatch):
    """A Predictor read a model file of any size whole into memory (then onnxruntime held a
    second copy): a file larger than edgefl.infer.MAX_MODEL_BYTES is refused by its size."""
    import edgefl.infer as infer

    blobs, _, _ = two_models
    path = tmp_path / "m.onnx"
    atomic_write(path, blobs[0])
    monkeypatch.setattr(infer, "MAX_MODEL_BYTES", len(blobs[0]) - 1)
    with pytest.raises(ModelFileError, match=rf"{re.escape(str(path))}: {len(blobs[0])} bytes, "
                                             rf"more than the {len(blobs[0]) - 1} a model file "
                                             r"may have"):
        Predictor(path)
    with pytest.raises(ModelFileError, match=rf"\(received\): {len(blobs[0])} bytes, more than"):
        install_model(blobs[0], tmp_path / "state")
