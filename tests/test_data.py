"""Datasets: the loaders' contract (float32, C-contiguous, normalised, labelled), the IDX and
CIFAR readers on files written here byte by byte, a board's npz/csv, synthetic(alpha, beta),
and the errors bad input gets."""
import gzip
import os
import struct

import numpy as np
import pytest

from edgefl.data import LOADERS, dataset_options, load_dataset
from edgefl.data.datasets import FASHION_MNIST_DIR
from edgefl.data.idx import parse_idx, read_idx


def assert_contract(ds, input_shape, num_classes):
    for x in (ds.x_train, ds.x_test):
        assert x.dtype == np.float32 and x.flags.c_contiguous
        assert x.shape[1:] == input_shape
    assert ds.input_shape == input_shape
    assert ds.num_classes == num_classes
    if num_classes:
        for y in (ds.y_train, ds.y_test):
            assert y.dtype == np.int32 and y.ndim == 1
            assert 0 <= y.min() and y.max() < num_classes
        assert len(ds.class_names) == num_classes
    assert len(ds.x_train) == len(ds.y_train) and len(ds.x_test) == len(ds.y_test)


def raw_of(ds, x):
    """Undo the normalisation: raw = x * std + mean over the channel (images) or last axis."""
    shape = (-1, 1, 1) if x.ndim == 4 else (-1,)
    return x * ds.norm_std.reshape(shape) + ds.norm_mean.reshape(shape)


# ---------------------------------------------------------------------------------------
# digits
# ---------------------------------------------------------------------------------------

def test_digits_is_a_stratified_normalised_split_of_sklearns_1797_images():
    from sklearn.datasets import load_digits
    ds = load_dataset("digits")
    assert_contract(ds, (1, 8, 8), 10)
    assert (len(ds.y_train), len(ds.y_test)) == (1438, 359)
    # normalised with the training split's scalar mean/std
    assert abs(float(ds.x_train.mean())) < 1e-4 and abs(float(ds.x_train.std()) - 1) < 1e-4
    raw_train, raw_test = raw_of(ds, ds.x_train), raw_of(ds, ds.x_test)
    np.testing.assert_allclose(raw_train, np.round(raw_train), atol=1e-4)
    assert ds.raw_range == (0, 16) and raw_train.min() > -1e-3 and raw_train.max() < 16 + 1e-3
    # train + test is exactly sklearn's set, each image once
    bunch = load_digits()
    ours = np.concatenate([np.round(raw_train).reshape(-1, 64), np.round(raw_test).reshape(-1, 64)])
    ours = np.concatenate([ours, np.concatenate([ds.y_train, ds.y_test])[:, None]], axis=1)
    theirs = np.concatenate([bunch.data, bunch.target[:, None]], axis=1)
    np.testing.assert_array_equal(np.unique(ours, axis=0), np.unique(theirs, axis=0))
    # stratified: every class has 20% (rounded) of its samples in the test split
    totals = np.bincount(bunch.target, minlength=10)
    np.testing.assert_array_equal(np.bincount(ds.y_test, minlength=10),
                                  np.floor(totals * 0.2 + 0.5))


def test_digits_split_is_fixed_from_load_to_load():
    a, b = load_dataset("digits"), load_dataset("digits")
    np.testing.assert_array_equal(a.x_test, b.x_test)
    np.testing.assert_array_equal(a.y_train, b.y_train)


def test_limits_keep_the_first_samples_without_changing_normalisation():
    full = load_dataset("digits")
    small = load_dataset("digits", limit_train=100, limit_test=7)
    np.testing.assert_array_equal(small.x_train, full.x_train[:100])
    np.testing.assert_array_equal(small.y_test, full.y_test[:7])
    np.testing.assert_array_equal(small.norm_mean, full.norm_mean)
    assert len(load_dataset("digits", limit_train=10**6).y_train) == len(full.y_train)


def test_binary_even_odd_relabels_and_keeps_the_original_classes():
    ds = load_dataset("digits", binary="even-odd")
    assert_contract(ds, (1, 8, 8), 2)
    assert ds.class_names == ("odd", "even")
    np.testing.assert_array_equal(ds.y_train, (ds.y_train_original % 2 == 0).astype(np.int32))
    np.testing.assert_array_equal(ds.y_train_original, load_dataset("digits").y_train)
    assert load_dataset("digits").y_train_original is None


@pytest.mark.parametrize("options, message", [
    ({"limit_train": 0}, "limit_train must be a positive integer"),
    ({"limit_test": 2.5}, "limit_test must be a positive integer"),
    ({"binary": "parity"}, "'even-odd'"),
    ({"colour": True}, r"unknown option 'colour'; valid options: limit_train, limit_test, binary"),
])
def test_bad_options_name_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        load_dataset("digits", **options)


def test_unknown_dataset_lists_the_valid_names():
    with pytest.raises(ValueError, match="unknown dataset 'imagenet'; valid: digits, mnist, "
                                         "fashion-mnist, cifar10, npz, csv, synthetic"):
        load_dataset("imagenet")
    assert set(LOADERS) == {"digits", "mnist", "fashion-mnist", "cifar10", "npz", "csv",
                            "synthetic"}


def test_required_option_is_named():
    with pytest.raises(ValueError, match="option 'path' is required"):
        load_dataset("npz")


# ---------------------------------------------------------------------------------------
# IDX
# ---------------------------------------------------------------------------------------

def idx_bytes(array: np.ndarray, code: int) -> bytes:
    """An IDX file written by hand: 0x0000, type code, ndim, big-endian dims, big-endian data."""
    big = array.astype(array.dtype.newbyteorder(">"))
    return (struct.pack(">HBB", 0, code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
            + big.tobytes())


@pytest.mark.parametrize("dtype, code", [("u1", 0x08), ("i1", 0x09), ("i2", 0x0B), ("i4", 0x0C),
                                         ("f4", 0x0D), ("f8", 0x0E)])
@pytest.mark.parametrize("compress", [False, True])
def test_read_idx_decodes_every_type_plain_and_gzipped(tmp_path, dtype, code, compress):
    array = (np.arange(2 * 3 * 5) - 7).astype(dtype).reshape(2, 3, 5)
    data = idx_bytes(array, code)
    path = tmp_path / ("a.idx.gz" if compress else "a.idx")
    path.write_bytes(gzip.compress(data) if compress else data)
    out = read_idx(path)
    assert out.shape == (2, 3, 5) and out.dtype == np.dtype(dtype).newbyteorder("=")
    np.testing.assert_array_equal(out, array)


@pytest.mark.parametrize("data, message", [
    (b"\x00\x00", "too short"),
    (b"\x01\x00\x08\x01" + b"\x00" * 8, "not an IDX file"),
    (b"\x00\x00\x07\x01" + b"\x00" * 8, "not an IDX file"),
    (b"\x00\x00\x08\x00", "0 dimensions"),
    (b"\x00\x00\x08\x03\x00\x00\x00\x02", "truncated IDX header"),
    (struct.pack(">HBBI", 0, 8, 1, 5) + b"\x01\x02\x03", r"shape \(5,\).*holds 3 bytes"),
])
def test_malformed_idx_names_the_file_and_the_problem(data, message):
    with pytest.raises(ValueError, match=f"bad.idx: .*{message}"):
        parse_idx(data, source="bad.idx")


def write_mnist_dir(directory, n_train=12, n_test=5, gz=(True, False, True, False), dotted=False):
    rng = np.random.default_rng(1)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": (np.arange(n_train) % 10).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": (np.arange(n_test) * 3 % 10).astype(np.uint8),
    }
    os.makedirs(directory, exist_ok=True)
    for (stem, array), compress in zip(arrays.items(), gz):
        data = idx_bytes(array, 0x08)
        name = stem.replace("-idx", ".idx") if dotted else stem
        with open(os.path.join(directory, name + (".gz" if compress else "")), "wb") as f:
            f.write(gzip.compress(data) if compress else data)
    return arrays


@pytest.mark.parametrize("name, mean, std", [("mnist", 0.1307, 0.3081),
                                             ("fashion-mnist", 0.2860, 0.3530)])
def test_idx_datasets_load_channels_first_with_the_standard_normalisation(tmp_path, name, mean,
                                                                          std):
    arrays = write_mnist_dir(tmp_path)
    ds = load_dataset(name, path=str(tmp_path))
    assert_contract(ds, (1, 28, 28), 10)
    np.testing.assert_allclose(ds.norm_mean, [mean * 255], rtol=1e-6)
    np.testing.assert_allclose(ds.norm_std, [std * 255], rtol=1e-6)
    np.testing.assert_allclose(raw_of(ds, ds.x_train)[:, 0], arrays["train-images-idx3-ubyte"],
                               atol=1e-3)
    np.testing.assert_array_equal(ds.y_test, arrays["t10k-labels-idx1-ubyte"])
    assert ds.raw_range == (0, 255)


def test_idx_loader_accepts_the_dotted_file_names(tmp_path):
    arrays = write_mnist_dir(tmp_path, dotted=True)
    ds = load_dataset("mnist", path=str(tmp_path))
    np.testing.assert_array_equal(ds.y_train, arrays["train-labels-idx1-ubyte"])


def test_missing_fashion_mnist_directory_says_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere does not exist; install Debian's package "
                                                r"\(apt-get install dataset-fashion-mnist\)"):
        load_dataset("fashion-mnist", path=str(tmp_path / "nowhere"))


def test_missing_idx_file_is_named(tmp_path):
    write_mnist_dir(tmp_path)
    os.remove(tmp_path / "t10k-images-idx3-ubyte.gz")
    with pytest.raises(FileNotFoundError,
                       match="no t10k-images-idx3-ubyte or t10k-images-idx3-ubyte.gz"):
        load_dataset("mnist", path=str(tmp_path))


def test_idx_label_count_mismatch_names_both_files(tmp_path):
    write_mnist_dir(tmp_path)   # the train labels are the plain (not gzipped) file
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(11, np.uint8), 0x08))
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz has 12 samples but .*"
                                         r"train-labels-idx1-ubyte has 11"):
        load_dataset("mnist", path=str(tmp_path))


def test_empty_idx_images_are_rejected(tmp_path):
    write_mnist_dir(tmp_path, n_test=0)
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte.gz is empty"):
        load_dataset("mnist", path=str(tmp_path))


@pytest.mark.parametrize("damage, message", [
    # a download cut short: gzip's EOFError named no file and reached the CLI as a traceback
    (lambda gz: gz[:len(gz) // 2], "truncated gzip"),
    (lambda gz: gz[:-4], "truncated gzip"),
    # one flipped byte in the deflate stream: gzip's "CRC check failed" (or a zlib error)
    (lambda gz: gz[:len(gz) // 2] + bytes([gz[len(gz) // 2] ^ 0x55]) + gz[len(gz) // 2 + 1:],
     "damaged gzip"),
    (lambda gz: gz + b"garbage!", "damaged gzip"),
], ids=["half", "no-trailer", "flipped-byte", "trailing-garbage"])
def test_a_damaged_gzip_idx_file_names_the_file_and_writes_no_cache(tmp_path, monkeypatch,
                                                                     damage, message):
    monkeypatch.setenv("EDGEFL_CACHE_DIR", str(tmp_path / "cache"))
    write_mnist_dir(tmp_path / "m")   # the train images are gzipped
    gz = tmp_path / "m" / "train-images-idx3-ubyte.gz"
    gz.write_bytes(damage(gz.read_bytes()))
    with pytest.raises(ValueError, match=f"train-images-idx3-ubyte.gz: {message}"):
        read_idx(gz)
    with pytest.raises(ValueError, match=f"train-images-idx3-ubyte.gz: {message}"):
        load_dataset("mnist", path=str(tmp_path / "m"))
    cached = os.listdir(tmp_path / "cache") if (tmp_path / "cache").exists() else []
    assert not [f for f in cached if f.endswith(".npz") or f.endswith(".tmp")]


@pytest.mark.parametrize("labels, code, message", [
    # int8 -1 loaded as class -1 (the training's one-hot then indexes from the end)
    (np.array([0, 1, -1, 3], np.int8), 0x09, "negative label -1"),
    # float 1.5 was cast to class 1 in silence
    (np.array([0, 1, 1.5, 3], np.float32), 0x0D, "non-integer values"),
])
def test_idx_labels_that_are_no_class_name_the_file(tmp_path, labels, code, message):
    write_mnist_dir(tmp_path, n_train=4)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(idx_bytes(labels, code))
    with pytest.raises(ValueError, match=f"train-labels-idx1-ubyte.*{message}"):
        load_dataset("mnist", path=str(tmp_path))


@pytest.mark.fashion_mnist
def test_real_fashion_mnist_from_debians_package():
    if not os.path.isdir(FASHION_MNIST_DIR):
        pytest.skip(f"{FASHION_MNIST_DIR} is absent: apt-get install dataset-fashion-mnist")
    images = read_idx(os.path.join(FASHION_MNIST_DIR, "train-images-idx3-ubyte.gz"))
    assert images.shape == (60000, 28, 28)
    assert abs(images.mean() / 255 - 0.2860) < 5e-4 and abs(images.std() / 255 - 0.3530) < 5e-4
    ds = load_dataset("fashion-mnist", limit_train=2000)
    assert_contract(ds, (1, 28, 28), 10)
    assert len(ds.y_train) == 2000 and len(ds.y_test) == 10000
    np.testing.assert_array_equal(np.bincount(ds.y_test), [1000] * 10)
    assert ds.class_names[0] == "T-shirt/top" and ds.class_names[9] == "Ankle boot"


# ---------------------------------------------------------------------------------------
# CIFAR-10 binary batches
# ---------------------------------------------------------------------------------------

def write_cifar_dir(directory, per_batch=4, test=3):
    rng = np.random.default_rng(2)
    os.makedirs(directory, exist_ok=True)
    records = {}
    files = [(f"data_batch_{i}.bin", per_batch) for i in range(1, 6)] + [("test_batch.bin", test)]
    for name, n in files:
        rows = rng.integers(0, 256, (n, 3073), dtype=np.uint8)
        rows[:, 0] = rng.integers(0, 10, n)
        (directory / name).write_bytes(rows.tobytes())
        records[name] = rows
    return records


@pytest.mark.parametrize("subdir", [False, True])
def test_cifar10_reads_records_as_channels_first_images(tmp_path, subdir):
    root = tmp_path / "cifar"
    records = write_cifar_dir(root / "cifar-10-batches-bin" if subdir else root)
    ds = load_dataset("cifar10", path=str(root))
    assert_contract(ds, (3, 32, 32), 10)
    assert len(ds.y_train) == 20 and len(ds.y_test) == 3
    first = records["data_batch_1.bin"][0]
    raw = raw_of(ds, ds.x_train)
    assert ds.y_train[0] == first[0]
    # a record is the red plane, then green, then blue, each 32x32 row-major
    np.testing.assert_allclose(raw[0, 0], first[1:1025].reshape(32, 32), atol=2e-3)
    np.testing.assert_allclose(raw[0, 2], first[2049:].reshape(32, 32), atol=2e-3)
    sixth = records["data_batch_2.bin"][1]
    assert ds.y_train[5] == sixth[0]
    np.testing.assert_allclose(ds.norm_mean, np.array([0.4914, 0.4822, 0.4465]) * 255, rtol=1e-6)
    assert ds.class_names[0] == "airplane"


def test_cifar10_truncated_batch_is_named(tmp_path):
    write_cifar_dir(tmp_path)
    with open(tmp_path / "data_batch_3.bin", "ab") as f:
        f.write(b"\x00" * 10)
    with pytest.raises(ValueError,
                       match=r"data_batch_3.bin: 12302 bytes is not a whole number of 3073-byte"):
        load_dataset("cifar10", path=str(tmp_path))


def test_cifar10_missing_batches_are_listed(tmp_path):
    write_cifar_dir(tmp_path)
    os.remove(tmp_path / "data_batch_4.bin")
    os.remove(tmp_path / "test_batch.bin")
    with pytest.raises(FileNotFoundError, match="lacks data_batch_4.bin, test_batch.bin"):
        load_dataset("cifar10", path=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_dataset("cifar10", path=str(tmp_path / "absent"))


# ---------------------------------------------------------------------------------------
# npz
# ---------------------------------------------------------------------------------------

def test_npz_tabular_is_standardised_per_feature(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.normal([5.0, -2.0, 100.0], [1.0, 3.0, 10.0], (200, 3))
    y = rng.integers(0, 4, 200)
    np.savez(tmp_path / "d.npz", x_train=x[:150], y_train=y[:150], x_test=x[150:], y_test=y[150:])
    ds = load_dataset("npz", path=str(tmp_path / "d.npz"), class_names=["a", "b", "c", "d"])
    assert_contract(ds, (3,), 4)
    np.testing.assert_allclose(ds.x_train.mean(axis=0), 0, atol=1e-5)
    np.testing.assert_allclose(ds.x_train.std(axis=0), 1, atol=1e-5)
    np.testing.assert_allclose(raw_of(ds, ds.x_test), x[150:], rtol=1e-5)
    assert ds.class_names == ("a", "b", "c", "d")


def test_a_feature_whose_spread_float32_cannot_hold_is_left_unscaled(tmp_path):
    # a column of values around 1e-45 has a float64 std of ~5e-46, which is 0 in float32:
    # the column became NaN and inf
    rng = np.random.default_rng(3)
    x = np.stack([rng.normal(0, 1, 200), rng.choice([0.0, 1.4e-45], 200)], axis=1)
    y = rng.integers(0, 2, 200)
    np.savez(tmp_path / "d.npz", x_train=x[:150], y_train=y[:150], x_test=x[150:],
             y_test=y[150:])
    ds = load_dataset("npz", path=str(tmp_path / "d.npz"))
    assert np.isfinite(ds.x_train).all() and np.isfinite(ds.x_test).all()
    assert ds.norm_std[1] == 1.0
    np.testing.assert_allclose(ds.x_train.std(axis=0)[0], 1, atol=1e-5)


def test_npz_custom_keys_channels_last_and_a_test_fraction(tmp_path):
    x = np.arange(40 * 4 * 4 * 3, dtype=np.uint8).reshape(40, 4, 4, 3)
    y = np.arange(40) % 2
    np.savez(tmp_path / "img.npz", X=x, Y=y)
    ds = load_dataset("npz", path=str(tmp_path / "img.npz"), x_train="X", y_train="Y",
                      test_fraction=0.25, channels_last=True, normalize="none")
    assert_contract(ds, (3, 4, 4), 2)
    assert (len(ds.y_train), len(ds.y_test)) == (30, 10)
    assert np.bincount(ds.y_test).tolist() == [5, 5]
    # channels moved first: x_train[i, c] is the c-th colour plane of the stored image
    stored = {tuple(img.ravel()) for img in x.transpose(0, 3, 1, 2).astype(np.float32)}
    assert all(tuple(img.ravel()) in stored for img in ds.x_train)


def test_npz_regression_targets(tmp_path):
    x = np.random.default_rng(4).normal(size=(30, 2))
    np.savez(tmp_path / "r.npz", x_train=x[:20], y_train=x[:20] @ [1.0, 2.0],
             x_test=x[20:], y_test=x[20:] @ [1.0, 2.0])
    ds = load_dataset("npz", path=str(tmp_path / "r.npz"), task="regression")
    assert ds.num_classes == 0 and ds.class_names == ()
    assert ds.y_train.dtype == np.float32 and ds.y_train.shape == (20,)


@pytest.mark.parametrize("arrays, message", [
    ({"x_train": np.zeros((3, 2)), "y_train": np.zeros(2), "x_test": np.zeros((1, 2)),
      "y_test": np.zeros(1)}, "x_train has 3 samples but y_train has 2"),
    ({"x_train": np.zeros((0, 2)), "y_train": np.zeros(0), "x_test": np.zeros((1, 2)),
      "y_test": np.zeros(1)}, r"x_train is empty \(shape \(0, 2\)\)"),
    ({"x_train": np.array([[0.0, np.nan]]), "y_train": np.zeros(1), "x_test": np.zeros((1, 2)),
      "y_test": np.zeros(1)}, "x_train has non-finite values"),
    ({"x_train": np.zeros((2, 2)), "y_train": np.zeros(2), "x_test": np.zeros((1, 3)),
      "y_test": np.zeros(1)}, r"x_test has per-sample shape \(3,\) but x_train has \(2,\)"),
    ({"x_train": np.zeros((2, 2)), "y_train": np.array([0.5, 1.0]), "x_test": np.zeros((1, 2)),
      "y_test": np.zeros(1)}, "y_train holds non-integer values"),
    ({"x_train": np.zeros((2, 2)), "y_train": np.zeros(2)}, r"no test arrays 'x_test'/'y_test'"),
    ({"inputs": np.zeros((2, 2))}, r"no array 'x_train' \(the file holds \['inputs'\]\)"),
])
def test_bad_npz_names_the_file_and_key(tmp_path, arrays, message):
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError, match=f"bad.npz: {message}"):
        load_dataset("npz", path=str(tmp_path / "bad.npz"))


@pytest.mark.parametrize("arrays, message", [
    # an object array: np.load's "Object arrays cannot be loaded..." named neither file nor key
    ({"x_train": np.array([None] * 2, dtype=object)}, r"x_train holds Python objects"),
    # the wrong array's dtype was named ("features must be numeric, got float64")
    ({"x_test": np.array([["a", "b"]])}, r"x_test must hold real numbers .*got <U1"),
    # complex features loaded, the imaginary part silently dropped
    ({"x_train": np.zeros((2, 2)) + 1j}, r"x_train must hold real numbers .*got complex128"),
    # a scalar label array was a TypeError (len() of unsized object)
    ({"y_train": np.array(1)}, r"y_train has shape \(\); expected one entry per sample"),
    # finite float64 that float32 cannot hold became inf in the training set
    ({"x_train": np.array([[0.0, 1e39], [0.0, 1.0]])},
     r"x_train has values beyond float32's range \(first in sample 0\)"),
    # labels no class count can mean: a silent 3,000,001-class model (a label of 3e9 was a
    # hang building its class names), 2**63 called "negative", 1e30 cast to garbage
    ({"y_train": np.array([0, 3_000_000])}, r"y_train has label 3000000; edgefl takes class "
                                             r"labels 0\.\.1048575"),
    ({"y_train": np.array([0, 2 ** 63], dtype=np.uint64)},
     r"y_train has label 9223372036854775808"),
    ({"y_train": np.array([0.0, 1e30])}, r"y_train has label 1e\+30"),
    # a label outside num_classes named no array
    ({"y_test": np.array([5])}, r"y_test: label 5 is outside 0\.\.1 \(num_classes=2\)"),
])
def test_bad_npz_dtypes_and_labels_name_the_file_and_key(tmp_path, arrays, message):
    good = {"x_train": np.zeros((2, 2)), "y_train": np.array([0, 1]), "x_test": np.zeros((1, 2)),
            "y_test": np.array([1])}
    np.savez(tmp_path / "bad.npz", **{**good, **arrays})
    options = {"num_classes": 2} if "y_test" in arrays else {}
    with pytest.raises(ValueError, match=f"bad.npz: {message}"):
        load_dataset("npz", path=str(tmp_path / "bad.npz"), **options)


@pytest.mark.parametrize("arrays, options, message", [
    # regression targets float32 cannot hold trained as inf (the features were checked, the
    # targets not)
    ({"y_train": np.array([1.0, 1e39]), "y_test": np.array([1.0])}, {"task": "regression"},
     r"y_train has values beyond float32's range \(first in sample 1\)"),
    ({"y_train": np.array([1.0, 2.0]), "y_test": np.array([-1e39])}, {"task": "regression"},
     r"y_test has values beyond float32's range \(first in sample 0\)"),
    # regression targets that are text, split by test_fraction: NumPy's "could not convert
    # string to float" named neither file nor key
    ({"x_train": np.zeros((4, 2)), "y_train": np.array(["a", "b", "c", "d"])},
     {"task": "regression", "test_fraction": 0.5},
     r"regression targets y_train must be numeric, got <U1"),
    # no features at all: NumPy's "zero-size array to reduction operation minimum"
    ({"x_train": np.zeros((2, 0)), "x_test": np.zeros((1, 0))}, {},
     r"x_train has no features \(shape \(2, 0\)\)"),
    ({"x_train": np.zeros((2, 0, 3)), "x_test": np.zeros((1, 0, 3))}, {"normalize": "none"},
     r"x_train has no features \(shape \(2, 1, 0, 3\)\)"),
])
def test_bad_npz_targets_and_featureless_x_name_the_file_and_key(tmp_path, arrays, options,
                                                                 message):
    good = {"x_train": np.zeros((2, 2)), "y_train": np.array([0, 1]), "x_test": np.zeros((1, 2)),
            "y_test": np.array([1])}
    data = {**good, **arrays}
    if "test_fraction" in options:
        del data["x_test"], data["y_test"]
    np.savez(tmp_path / "bad.npz", **data)
    with pytest.raises(ValueError, match=f"bad.npz: {message}"):
        load_dataset("npz", path=str(tmp_path / "bad.npz"), **options)


def test_a_csv_regression_target_beyond_float32_is_named(tmp_path):
    (tmp_path / "bad.csv").write_text("a,label\n1,0\n2,1\n3,1e39\n4,1\n5,0\n")
    with pytest.raises(ValueError, match=r"bad.csv: label column 'label' has values beyond "
                                         r"float32's range"):
        load_dataset("csv", path=str(tmp_path / "bad.csv"), task="regression", test_fraction=0.2)


@pytest.mark.parametrize("name, options, message", [
    # NumPy's "expected non-negative integer" named no option
    ("synthetic", {"seed": -1}, r"synthetic: seed must be an integer >= 0, got -1"),
    ("npz", {"test_fraction": 0.5, "split_seed": -1}, r"npz: split_seed must be an integer >= 0"),
    ("csv", {"split_seed": -3}, r"csv: split_seed must be an integer >= 0, got -3"),
])
def test_a_negative_seed_names_the_option(tmp_path, name, options, message):
    np.savez(tmp_path / "d.npz", x_train=np.zeros((4, 2)), y_train=np.array([0, 1, 0, 1]))
    (tmp_path / "d.csv").write_text("a,label\n1,0\n2,1\n3,0\n4,1\n5,0\n")
    if name != "synthetic":
        options = {"path": str(tmp_path / f"d.{name}"), **options}
    with pytest.raises(ValueError, match=message):
        load_dataset(name, **options)


def test_num_classes_beyond_what_a_model_can_have_is_named(tmp_path):
    np.savez(tmp_path / "d.npz", x_train=np.zeros((2, 2)), y_train=np.array([0, 1]),
             x_test=np.zeros((1, 2)), y_test=np.array([1]))
    # just past the bound: 2**32 was a hang and the out-of-memory killer, which a test must
    # not risk should the check regress (this asks for a million class names at worst)
    with pytest.raises(ValueError, match=r"npz: num_classes must be 1\.\.1048576, got 1048577"):
        load_dataset("npz", path=str(tmp_path / "d.npz"), num_classes=2 ** 20 + 1)


@pytest.mark.parametrize("kind, options, message", [
    # options of the wrong kind: each was a TypeError from inside os, numpy or csv
    ("npz", {"path": [1]}, "npz: path must be a non-empty string, got [1]"),
    ("npz", {"x_train": [1]}, "npz: x_train must be a non-empty string, got [1]"),
    ("npz", {"class_names": True}, "npz: class_names must be a list of names (strings), "
                                   "got True"),
    ("csv", {"delimiter": "abc"}, "csv: delimiter must be one character, got 'abc'"),
    ("csv", {"label": [1]}, "csv: label must be a column's name or index, got [1]"),
    ("csv", {"class_names": "x"}, "csv: class_names must be a list of names (strings), "
                                  "got 'x'"),
])
def test_options_of_the_wrong_kind_are_named(tmp_path, kind, options, message):
    np.savez(tmp_path / "d.npz", x_train=np.zeros((4, 2)), y_train=np.arange(4) % 2,
             x_test=np.zeros((2, 2)), y_test=np.arange(2))
    (tmp_path / "d.csv").write_text("a,label\n" + "".join(f"{i},{i % 2}\n" for i in range(8)))
    options = {"path": str(tmp_path / f"d.{kind}"), **options}
    with pytest.raises(ValueError) as exc:
        load_dataset(kind, **options)
    assert str(exc.value) == message
    # a quoted number is the number (check_real), here as everywhere
    assert len(load_dataset("csv", path=str(tmp_path / "d.csv"), test_fraction="0.25").y_test) == 2
    # a pathlib.Path, as code passes a file, is a path
    assert load_dataset(kind, path=tmp_path / f"d.{kind}").x_train.shape[1] == \
        (2 if kind == "npz" else 1)


def test_missing_npz_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.npz does not exist"):
        load_dataset("npz", path=str(tmp_path / "absent.npz"))


def test_a_file_that_is_not_an_npz_archive_is_named(tmp_path):
    # np.load read random bytes as a pickle and spoke of allow_pickle, naming no file
    junk = tmp_path / "junk.npz"
    junk.write_bytes(np.random.default_rng(0).bytes(256))
    with pytest.raises(ValueError, match=r"junk\.npz: not an \.npz archive"):
        load_dataset("npz", path=str(junk))
    np.save(tmp_path / "one.npy", np.zeros(3))       # an .npy is one array, not an archive
    with pytest.raises(ValueError, match=r"one\.npy: not an \.npz archive"):
        load_dataset("npz", path=str(tmp_path / "one.npy"))


@pytest.mark.parametrize("name", ["npz", "csv"])
def test_a_directory_given_as_the_data_file_is_called_a_directory(tmp_path, name):
    # was "file /tmp does not exist": it exists, it is a directory
    with pytest.raises(ValueError, match=f"{name}: {tmp_path} is a directory, not a .{name} file"):
        load_dataset(name, path=str(tmp_path))


@pytest.mark.parametrize("kind", ["junk-npz", "csv-directory"])
def test_bad_data_files_reach_the_cli_as_one_line(tmp_path, capsys, kind):
    import re

    from edgefl.cli import main

    if kind == "junk-npz":
        (tmp_path / "d.npz").write_bytes(b"\x00\xffjunk" * 40)
        overrides = ["dataset.name=npz", f"dataset.path={tmp_path / 'd.npz'}"]
        message = r"d\.npz: not an \.npz archive"
    else:
        overrides = ["dataset.name=csv", f"dataset.path={tmp_path}"]
        message = f"{re.escape(str(tmp_path))} is a directory, not a \\.csv file"
    out = tmp_path / "o"
    args = ["simulate", "quickstart", "--out", str(out), "--quiet", "--no-plot", "--no-export"]
    for item in overrides:
        args += ["--set", item]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert re.search(message, err), err
    assert not out.exists()


def test_a_clients_data_setting_of_the_wrong_type_names_the_setting(tmp_path, capsys):
    # `edgefl client --set data=...` loads its data before it connects; the loader's words
    # alone ("synthetic: alpha must be ...") did not say which setting or file held them
    from edgefl.cli import main

    args = ["client", "--set", "data={name: synthetic, alpha: abc}", "--set", "node.id=c1",
            "--set", f"state_dir={tmp_path / 'state'}"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "--set data={name: synthetic, alpha: abc}: synthetic: alpha must be a number, " \
           "got 'abc'" in err, err


def test_a_csv_that_is_not_utf8_is_named(tmp_path):
    (tmp_path / "latin.csv").write_bytes(b"a,b\n1,\xe9\n")
    with pytest.raises(ValueError, match=r"latin\.csv: not UTF-8 text"):
        load_dataset("csv", path=str(tmp_path / "latin.csv"), label="a")


# ---------------------------------------------------------------------------------------
# csv
# ---------------------------------------------------------------------------------------

def test_csv_with_header_label_by_name_and_a_stratified_split(tmp_path):
    lines = ["f1,label,f2"] + [f"{i},{i % 3},{2 * i}" for i in range(30)]
    (tmp_path / "d.csv").write_text("\n".join(lines) + "\n")
    ds = load_dataset("csv", path=str(tmp_path / "d.csv"), label="label", test_fraction=0.2,
                      normalize="none")
    assert_contract(ds, (2,), 3)
    assert np.bincount(ds.y_test).tolist() == [2, 2, 2]
    np.testing.assert_array_equal(ds.x_train[:, 1], 2 * ds.x_train[:, 0])
    np.testing.assert_array_equal(ds.y_train, ds.x_train[:, 0].astype(int) % 3)


def test_csv_without_header_label_by_index_and_a_test_file(tmp_path):
    (tmp_path / "a.csv").write_text("0.5;1;7\n1.5;2;9\n2.5;1;11\n")
    (tmp_path / "b.csv").write_text("3.5;1;13\n")
    ds = load_dataset("csv", path=str(tmp_path / "a.csv"), test_path=str(tmp_path / "b.csv"),
                      label=-1, delimiter=";", normalize="none", task="regression")
    np.testing.assert_array_equal(ds.y_train, [7, 9, 11])
    np.testing.assert_array_equal(ds.x_test, [[3.5, 1.0]])


@pytest.mark.parametrize("text, options, message", [
    ("a,b\n1,2\n3,x\n", {"label": "b"}, r"line 3, column 'b': 'x' is not a number"),
    ("a,b\n1,2\n3\n", {"label": "b"}, "line 3 has 1 columns, expected 2"),
    ("", {}, "the file is empty"),
    ("a,b\n", {"label": "b"}, "the file has a header but no data rows"),
    ("a,b\n1,2\n", {"label": "target"}, "no column named 'target'; columns: a, b"),
    ("1,2\n3,4\n", {"label": "label"}, "has no header row"),
    # two columns of one name: the label was silently the first of them
    ("label,b,label\n1,2,0\n3,4,1\n", {"label": "label"},
     "the header names column 'label' 2 times \\(columns 0, 2\\)"),
    ("a,b\n1,nan\n2,3\n3,4\n4,5\n5,6\n", {"label": "a"}, "features has non-finite values"),
])
def test_bad_csv_names_the_file_line_and_column(tmp_path, text, options, message):
    (tmp_path / "bad.csv").write_text(text)
    with pytest.raises(ValueError, match=f"bad.csv: {message}"):
        load_dataset("csv", path=str(tmp_path / "bad.csv"), **options)


@pytest.mark.parametrize("text, options, message", [
    # a non-finite cell was reported as "first in sample k" of the shuffled training split,
    # which is no line of the file
    ("a,b,label\n1,0,0\n2,0,1\n3,1,1\n4,1,0\n5,0,1\n6,inf,0\n", {},
     r"features has non-finite values \(line 7, column 'b': inf\)"),
    ("a,label\n1,0\n2,1\n3,1\n4,nan\n5,0\n", {"task": "regression"},
     r"label column 'label' has non-finite values \(line 5, column 'label': nan\)"),
    ("1,0\n2,1\n-inf,1\n4,0\n5,0\n", {"label": 1},
     r"features has non-finite values \(line 3, column 0: -inf\)"),
    # the label column was called "labels", a key the file does not have
    ("a,label\n1,0\n2,1\n3,2000000\n4,1\n5,0\n", {},
     r"label column 'label' has label 2000000"),
])
def test_a_csv_cell_that_is_not_finite_is_named_by_line_and_column(tmp_path, text, options,
                                                                     message):
    (tmp_path / "bad.csv").write_text(text)
    with pytest.raises(ValueError, match=f"bad.csv: {message}"):
        load_dataset("csv", path=str(tmp_path / "bad.csv"), **options)


# ---------------------------------------------------------------------------------------
# synthetic(alpha, beta)
# ---------------------------------------------------------------------------------------

def test_synthetic_defaults_follow_fedumf_appendix():
    ds = load_dataset("synthetic")
    assert_contract(ds, (30,), 5)
    assert len(ds.y_train) == 20 * 200 and len(ds.y_test) == 20 * 50
    np.testing.assert_array_equal(np.bincount(ds.client_ids), [200] * 20)
    np.testing.assert_array_equal(load_dataset("synthetic").x_train, ds.x_train)
    assert not np.array_equal(load_dataset("synthetic", seed=1).x_train, ds.x_train)


def label_skew(ds):
    """Mean total-variation distance between each client's label mix and the pooled mix."""
    pooled = np.bincount(ds.y_train, minlength=ds.num_classes) / len(ds.y_train)
    mixes = [np.bincount(ds.y_train[ds.client_ids == k], minlength=ds.num_classes)
             / np.sum(ds.client_ids == k) for k in range(ds.client_ids.max() + 1)]
    return float(np.mean([0.5 * np.abs(m - pooled).sum() for m in mixes]))


def test_synthetic_alpha_spreads_client_optima_and_beta_spreads_inputs():
    homogeneous = load_dataset("synthetic", alpha=0.0, beta=0.0)
    optima = load_dataset("synthetic", alpha=1.0, beta=0.0)
    inputs = load_dataset("synthetic", alpha=0.0, beta=1.0)
    assert label_skew(optima) > 2 * label_skew(homogeneous)

    def input_spread(ds):
        means = np.array([ds.x_train[ds.client_ids == k].mean(axis=0) for k in range(20)])
        return float(np.linalg.norm(means - means.mean(axis=0), axis=1).mean())
    assert input_spread(inputs) > 3 * input_spread(homogeneous)
    assert input_spread(optima) < 2 * input_spread(homogeneous)


def test_synthetic_lognormal_sizes_vary_with_size_sigma():
    sizes = np.bincount(load_dataset("synthetic", size_sigma=1.0).client_ids)
    assert sizes.min() >= 1 and sizes.max() > 2 * sizes.min()


@pytest.mark.parametrize("options, message", [
    ({"classes": 1}, "classes must be at least 2"),
    ({"dim": 0}, "dim must be a positive integer"),
    ({"alpha": -1.0}, "alpha must be >= 0"),
    # of the wrong type: were TypeErrors ('>=' not supported between 'str' and 'int')
    ({"alpha": "abc"}, "synthetic: alpha must be a number, got 'abc'"),
    ({"beta": [1]}, r"synthetic: beta must be a finite number, got \[1\]"),
    ({"beta": True}, "synthetic: beta must be a finite number, got True"),
    ({"size_sigma": "abc"}, "synthetic: size_sigma must be a number, got 'abc'"),
    ({"test_fraction": "abc"}, "synthetic: test_fraction must be a number, got 'abc'"),
    ({"seed": "abc"}, "synthetic: seed must be an integer, got 'abc'"),
])
def test_synthetic_rejects_bad_parameters(options, message):
    with pytest.raises(ValueError, match=message):
        load_dataset("synthetic", **options)


def test_every_loader_lists_its_options():
    assert "path" in dataset_options("fashion-mnist")
    assert {"alpha", "beta", "dim", "limit_train"} <= set(dataset_options("synthetic"))


def test_a_csv_header_repeating_names_other_than_the_labels_is_read(tmp_path):
    """Blank header cells (a spreadsheet's export) or repeated feature names are no
    ambiguity: only a repeated name that `label` looks up is refused."""
    rows = "".join(f"{i},{i % 3},{i % 5},{i % 2}\n" for i in range(20))
    (tmp_path / "blank.csv").write_text("a,,,label\n" + rows)
    ds = load_dataset("csv", path=str(tmp_path / "blank.csv"), normalize="none")
    assert ds.x_train.shape[1] == ds.x_test.shape[1] == 3
    (tmp_path / "px.csv").write_text("px,px,px,label\n" + rows)
    assert load_dataset("csv", path=str(tmp_path / "px.csv"), label=-1,
                        normalize="none").x_train.shape[1] == 3
