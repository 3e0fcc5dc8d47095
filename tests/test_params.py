"""LayerTable over one flat buffer, and the model zoo's tables and initialisation."""
import numpy as np
import pytest

from edgefl.errors import KernelError
from edgefl.models import build_model, model_names
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


def test_model_options_are_checked():
    with pytest.raises(KernelError, match="unknown name 'resnet'; valid: .*cnn-mnist"):
        build_model("resnet", (4,), 2)
    with pytest.raises(KernelError, match=r"unknown option\(s\) \['hiden'\]"):
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
