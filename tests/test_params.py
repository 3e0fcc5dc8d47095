"""LayerTable over one flat buffer, and the model zoo's tables and initialisation."""
import re

import numpy as np
import pytest

from edgefl.errors import KernelError
from edgefl.models import ModelSpecError, build_model, model_names
from edgefl.params import LayerTable


def test_layer_views_are_views_not_copies():
    model = build_model({"name": "mlp", "hidden": [5]}, (4,), 3)
    buf = model.init(0)
    views = model.table.views(buf)
    for name, v in views.items():
        assert np.shares_memory(v, buf), name
        assert v.shape == model.table[name].shape
    views["fc1.weight"][0, 0] = 42.0
    assert buf[model.table["fc1.weight"].offset] == 42.0
    # an extra buffer (momentum, stored update) shares the table
    momentum = model.table.zeros()
    model.table.view(momentum, "fc2.bias")[:] = 1.0
    e = model.table["fc2.bias"]
    assert momentum[e.offset:e.offset + e.size].tolist() == [1.0] * 3
    assert momentum.sum() == 3.0


def test_table_hash_is_content_addressed():
    a = LayerTable.from_shapes([("w", (3, 2)), ("b", (3,))])
    b = LayerTable.from_shapes([("w", (3, 2)), ("b", (3,))])
    c = LayerTable.from_shapes([("w", (2, 3)), ("b", (3,))])
    assert a.digest == b.digest and a.hash64 == b.hash64
    assert a.digest != c.digest          # same size, different shapes
    assert a.size == c.size == 9
    assert LayerTable.from_json(a.to_json()).digest == a.digest
    assert a.segment_offsets().tolist() == [0, 6, 9]


def test_table_rejects_bad_layouts_and_buffers():
    with pytest.raises(KernelError, match="duplicate"):
        LayerTable.from_shapes([("w", (2,)), ("w", (2,))])
    with pytest.raises(KernelError, match="starts at 5, expected 2"):
        LayerTable((("a", (2,), 0), ("b", (2,), 5)))
    t = LayerTable.from_shapes([("w", (3, 2))])
    with pytest.raises(KernelError, match=r"shape \(5,\) does not match the layer table"):
        t.check(np.zeros(5, np.float32), "update")
    with pytest.raises(KernelError, match="float32"):
        t.check(np.zeros(6), "update")
    with pytest.raises(KernelError, match="no layer 'x'"):
        t.view(np.zeros(6, np.float32), "x")
    with pytest.raises(KernelError, match="missing layers"):
        t.pack({})


def test_pack_round_trips_views():
    model = build_model("cnn-mnist", (1, 28, 28), 10)
    buf = model.init(1)
    assert np.array_equal(model.table.pack(model.table.views(buf)), buf)


def test_pytorch_default_init_bounds_and_zero_init():
    model = build_model({"name": "mlp", "hidden": [64]}, (100,), 10)
    buf = model.init(0)
    w1 = model.table.view(buf, "fc1.weight")
    bound = 1 / np.sqrt(100)
    assert np.abs(w1).max() <= bound
    assert np.abs(w1).max() > 0.95 * bound          # uniform, filling the interval
    assert abs(float(w1.mean())) < 0.05 * bound
    b2 = model.table.view(buf, "fc2.bias")
    assert np.abs(b2).max() <= 1 / np.sqrt(64)
    assert not model.init(0, zero=True).any()
    conv = build_model("cnn-mnist", (1, 28, 28), 10)
    cw = conv.table.view(conv.init(0), "conv2.weight")
    assert np.abs(cw).max() <= 1 / np.sqrt(32 * 25)


@pytest.mark.parametrize("spec, key, problem", [
    # a string was iterated (hidden: "64" built layers of 6 and 4), 6.5 truncated to 6, and
    # the rest failed in int() or a comparison, naming no option
    ({"name": "mlp", "hidden": "64"}, "hidden", "must be a list of positive integers, got '64'"),
    ({"name": "mlp", "hidden": [6.5]}, "hidden", r"must be a list of positive integers, got \[6.5\]"),
    ({"name": "mlp", "hidden": [0]}, "hidden", r"must be a list of positive integers, got \[0\]"),
    ({"name": "mlp", "hidden": [True]}, "hidden", "must be a list of positive integers"),
    ({"name": "cnn", "fc": "abc"}, "fc", "must be a list of positive integers, got 'abc'"),
    ({"name": "cnn-mnist", "fc": [[1]]}, "fc", "must be a list of positive integers"),
    ({"name": "cnn", "conv": "abc"}, "conv", "must be a list of layers"),
    ({"name": "cnn", "conv": [{"out": 4, "k": "abc"}]}, r"conv\[0\]\.k",
     "must be an integer >= 1, got 'abc'"),
    ({"name": "cnn", "conv": [{"out": 4}]}, r"conv\[0\]", "needs out and k"),
    ({"name": "softmax", "bias": "no"}, "bias", "must be true or false, got 'no'"),
    ({"name": "linear", "outputs": 1.5}, "outputs", "must be a positive integer, got 1.5"),
    ({"name": "svm", "l2": "abc"}, "l2", "must be a finite number >= 0, got 'abc'"),
    ({"name": "svm", "l2": -1.0}, "l2", "must be a finite number >= 0, got -1.0"),
])
def test_model_options_of_the_wrong_type_name_the_option(spec, key, problem):
    with pytest.raises(ModelSpecError, match=f"model {spec['name']}: {key}: {problem}") as info:
        build_model(spec, (1, 8, 8), 10)
    assert re.fullmatch(key, info.value.key)      # what a run config names as model.<key>


def test_a_model_spec_stored_before_yaml_1_2_floats_still_builds():
    # `l2: 1e-4` was the string '1e-4' in checkpoints, summaries and queued runs made before
    # edgefl read YAML 1.2 floats: exporting or resuming them must still build the model
    assert build_model({"name": "svm", "l2": "1e-4"}, (4,), 2).l2 == pytest.approx(1e-4)


def test_model_options_are_checked():
    with pytest.raises(KernelError, match="unknown model 'resnet'; valid: .*cnn-mnist"):
        build_model("resnet", (4,), 2)
    with pytest.raises(KernelError, match="model mlp: hiden: unknown option of model mlp; "
                                          "valid: name, hidden"):
        build_model({"name": "mlp", "hiden": [3]}, (4,), 2)
    with pytest.raises(KernelError, match="binary task"):
        build_model("logreg", (4,), 10)
    with pytest.raises(KernelError, match="does not fit"):
        build_model("cnn-mnist", (1, 2, 2), 10)
    assert set(model_names()) >= {"linear", "logreg", "softmax", "svm", "mlp", "cnn",
                                  "cnn-mnist", "cnn-cifar", "lenet-cifar"}


def test_fedmr_units_cover_every_parameter_once():
    model = build_model("cnn-cifar", (3, 32, 32), 10)
    names = [n for unit in model.units for n in unit]
    assert sorted(names) == sorted(model.table.names)
    assert len(model.units) == 5                     # 2 conv + 3 dense layers
