"""Dataset loaders. Each reads one source into stored units (`Raw`); `finish` turns that into
the normalised float32 `Dataset` every other layer uses (docs/data.md).

Nothing here downloads: bundled data (scikit-learn's digits), files in a directory (IDX,
CIFAR-10 binary batches, npz, csv) or generated data (synthetic) only.
"""
from __future__ import annotations

import csv
import dataclasses
import os
import zipfile
from dataclasses import dataclass

import numpy as np

from .cache import cached_raw, register_kind
from .idx import find_idx, read_idx

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist
MNIST_DIR = "/usr/share/datasets/mnist"                    # no Debian package; copy files here
DIGITS_SPLIT_SEED = 0        # the fixed seed of digits' stratified 80/20 train/test split
DIGITS_TEST_FRACTION = 0.2

DIGIT_NAMES = tuple(str(i) for i in range(10))
FASHION_NAMES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                 "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
CIFAR10_NAMES = ("airplane", "automobile", "bird", "cat", "deer",
                 "dog", "frog", "horse", "ship", "truck")
EVEN_ODD_NAMES = ("odd", "even")   # label 1 = even digit, as the MFL paper's even/odd SVM task
# The most classes a dataset may have. Labels are int32 and every class gets a name and a
# model output, so a file's label of 3e9 (an id column taken for labels) or num_classes: 2**32
# built billions of class names before anything else ran and took the machine's memory; a
# million is far past any data set this runtime trains on.
MAX_CLASSES = 1 << 20


@dataclass(frozen=True)
class Dataset:
    """A train/test split ready for training: normalised float32 features, int32 labels.

    `x_*` are C-contiguous float32, (n, C, H, W) for images and (n, d) for tabular data, with
    raw = x * norm_std + norm_mean; the norm arrays have shape (C,) for images (broadcast over
    axis 1) and (d,) or (1,) for tabular data. `y_*` are int32 class labels (num_classes > 0)
    or float32 regression targets of shape (n,) or (n, k) (num_classes == 0).
    `client_ids` is each training sample's natural owner (synthetic data) or None.
    `y_train_original` keeps the class labels from before a relabelling (`binary="even-odd"`),
    so label-skew partitioners can split by the original digit as the MFL paper's Case 2
    (§7.2.2) does; else None.
    `train_rows`: None, or -- once a run has laid its split out (`data.layout.contiguous`
    reorders the training rows shard by shard) -- each training row's index in the source's
    order; `first_train(k)` still gives the source's first k samples.
    """
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    input_shape: tuple
    num_classes: int
    class_names: tuple
    norm_mean: np.ndarray
    norm_std: np.ndarray
    raw_range: tuple
    client_ids: np.ndarray | None = None
    y_train_original: np.ndarray | None = None
    train_rows: np.ndarray | None = None

    def first_train(self, k: int) -> np.ndarray:
        """x of the first k training samples in the source's order (whatever order the rows
        are in now: `train_rows`), e.g. an int8 export's calibration samples."""
        if self.train_rows is None:
            return self.x_train[:k]
        values, first = np.unique(self.train_rows, return_index=True)
        return self.x_train[first[values < k]]


@register_kind
@dataclass(frozen=True)
class Raw:
    """One source's arrays in stored units, plus how to normalise them (see `finish`)."""
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    class_names: tuple
    norm_mean: np.ndarray
    norm_std: np.ndarray
    raw_range: tuple
    client_ids: np.ndarray | None = None
    # the x arrays were made by the loader for this Raw alone (read from a file): finish() may
    # hand them out without a copy when they need no conversion (a board's float32 shard:
    # one copy of its data in memory, not two at load time)
    private: bool = False


# ---------------------------------------------------------------------------------------
# finishing: limits, relabelling, normalisation
# ---------------------------------------------------------------------------------------

def finish(raw: Raw, limit_train: int | None = None, limit_test: int | None = None,
           binary: str | bool | None = None) -> Dataset:
    """Apply the options every loader shares and normalise to float32.

    limit_train / limit_test keep the first N samples (all of them if fewer exist); the slice
    is taken before conversion so a small limit never materialises the whole set in float32.
    binary="even-odd" relabels classes to 1 (even) / 0 (odd), the MFL paper's convex task
    (§7.1: SVM, linear and logistic regression classify even against odd digits).
    """
    n_train = _limit("limit_train", limit_train, len(raw.y_train))
    n_test = _limit("limit_test", limit_test, len(raw.y_test))
    y_train, y_test = raw.y_train[:n_train], raw.y_test[:n_test]
    num_classes, class_names, original = raw.num_classes, raw.class_names, None
    if binary not in (None, False):
        if binary != "even-odd":
            raise ValueError(f"{raw.name}: binary={binary!r} is not a relabelling; use 'even-odd'")
        if raw.num_classes == 0:
            raise ValueError(f"{raw.name}: binary='even-odd' needs class labels, "
                             f"but this dataset has regression targets")
        original = np.ascontiguousarray(y_train, dtype=np.int32)
        y_train, y_test = (y_train % 2 == 0), (y_test % 2 == 0)
        num_classes, class_names = 2, EVEN_ODD_NAMES
    label_dtype = np.int32 if num_classes else np.float32
    x_train = _normalise(raw.x_train[:n_train], raw.norm_mean, raw.norm_std, raw.private)
    client_ids = None if raw.client_ids is None else raw.client_ids[:n_train].copy()
    return Dataset(
        name=raw.name,
        x_train=x_train,
        y_train=np.ascontiguousarray(y_train, dtype=label_dtype),
        x_test=_normalise(raw.x_test[:n_test], raw.norm_mean, raw.norm_std, raw.private),
        y_test=np.ascontiguousarray(y_test, dtype=label_dtype),
        input_shape=tuple(x_train.shape[1:]),
        num_classes=num_classes,
        class_names=tuple(class_names),
        norm_mean=np.asarray(raw.norm_mean, dtype=np.float32),
        norm_std=np.asarray(raw.norm_std, dtype=np.float32),
        raw_range=raw.raw_range,
        client_ids=client_ids,
        y_train_original=original,
    )


def _limit(key: str, value, n: int) -> int:
    if value is None:
        return n
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return min(int(value), n)


def _normalise(raw: np.ndarray, mean: np.ndarray, std: np.ndarray,
               private: bool = False) -> np.ndarray:
    """(raw - mean) / std in float32; mean/std broadcast over the channel axis of images.

    A fresh, writable, C-contiguous array -- or, when the loader made `raw` for this dataset
    alone (`private`) and it is already that in float32 with nothing to subtract or divide,
    `raw` itself (a view of all of it), so loading does not hold the data twice."""
    shape = (-1, 1, 1) if raw.ndim == 4 else (-1,)
    if private and raw.dtype == np.float32 and raw.flags.c_contiguous and raw.flags.writeable \
            and not np.any(mean) and np.all(np.asarray(std) == 1):
        return raw
    x = raw.astype(np.float32)   # always a fresh, writable, C-contiguous array
    x -= np.asarray(mean, dtype=np.float32).reshape(shape)
    x /= np.asarray(std, dtype=np.float32).reshape(shape)
    return x


def standardisation(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel (images) or per-feature (tabular) mean and std of `x`; a std of 0 becomes
    1, as does one below float32's smallest normal number (in float32 it is 0 or loses its
    digits, and the feature divided by it becomes NaN and inf)."""
    axes = (0, 2, 3) if x.ndim == 4 else (0,)
    mean = x.mean(axis=axes, dtype=np.float64)
    std = x.std(axis=axes, dtype=np.float64)
    std[std < np.finfo(np.float32).tiny] = 1.0
    return mean.astype(np.float32), std.astype(np.float32)


def stratified_split(y: np.ndarray, test_fraction: float, seed: int,
                     source: str = "dataset") -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) indices holding out round(test_fraction * n_c) samples of each class.

    Regression targets (float) are split uniformly at random instead.
    """
    test_fraction = check_real(source, "test_fraction", test_fraction)   # "0.25" too
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    rng = np.random.default_rng(check_seed(source, "split_seed", seed))
    groups = ([np.flatnonzero(y == c) for c in np.unique(y)]
              if np.issubdtype(y.dtype, np.integer) else [np.arange(len(y))])
    test = []
    for members in groups:
        n_test = int(np.floor(test_fraction * len(members) + 0.5))
        test.append(rng.permutation(members)[:n_test])
    test_idx = np.sort(np.concatenate(test))
    train_mask = np.ones(len(y), dtype=bool)
    train_mask[test_idx] = False
    return np.flatnonzero(train_mask), test_idx


def check_real(source: str, key: str, value, *, integer: bool = False):
    """`value` as a finite float (an int with integer=True), or ValueError "<source>: <key>
    must be a number, got 'abc'". The data layer's check of an option's type, for loaders and
    partitioners alike: a string, a list or a boolean (YAML's `true`) is refused, where a
    comparison with it was a TypeError, float() spoke of itself or True passed as 1. Bounds
    are the caller's, named in its own words. (Below edgefl.config, so its check_number is
    out of reach; the problems are worded alike.)"""
    if integer:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{source}: {key} must be an integer, got {value!r}")
        return int(value)
    if isinstance(value, str):              # a quoted number, or one stored as text by an
        # edgefl that read YAML 1.1 (where 1e-3, with no dot, is a string)
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{source}: {key} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not np.isfinite(value):
        raise ValueError(f"{source}: {key} must be a finite number, got {value!r}")
    return float(value)


def check_seed(source: str, key: str, value) -> int:
    """`value` as a seed for np.random.default_rng: an integer >= 0, else ValueError
    "<source>: <key> must be an integer >= 0" (NumPy's "expected non-negative integer"
    named no option)."""
    value = check_real(source, key, value, integer=True)
    if value < 0:
        raise ValueError(f"{source}: {key} must be an integer >= 0, got {value}")
    return value


def check_text(source: str, key: str, value, *, path: bool = False) -> str:
    """`value` if a non-empty string (an array's name; with path=True also an os.PathLike,
    as code passes a file), or ValueError "<source>: <key> must be ..., got [1]": a list
    there was a TypeError from deep inside os or numpy."""
    if path and isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{source}: {key} must be a non-empty string, got {value!r}")
    return value


def check_class_names(source: str, value) -> list | None:
    """class_names: None, or a list of strings (YAML's `true` or a bare word is refused
    here, not as a TypeError when the names are counted)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(n, str) for n in value):
        raise ValueError(f"{source}: class_names must be a list of names (strings), "
                         f"got {value!r}")
    return list(value)


def check_arrays(source: str, x_key: str, x: np.ndarray, y_key: str, y: np.ndarray) -> None:
    """Raise ValueError naming `source` and the key if x/y are scalars, empty, ragged or
    non-finite, x is not real numbers (strings, booleans, complex: the imaginary part was
    dropped in silence) or holds floats float32 cannot (they became inf in the training set)."""
    for key, a in ((x_key, x), (y_key, y)):
        if a.ndim == 0:
            raise ValueError(f"{source}: {key} has shape (); expected one entry per sample")
    if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
        raise ValueError(f"{source}: {x_key} must hold real numbers (integers or floats), "
                         f"got {x.dtype}")
    if np.issubdtype(y.dtype, np.complexfloating):
        raise ValueError(f"{source}: {y_key} must hold real numbers, got {y.dtype}")
    if len(x) == 0:
        raise ValueError(f"{source}: {x_key} is empty (shape {x.shape})")
    if x.size == 0:
        raise ValueError(f"{source}: {x_key} has no features (shape {x.shape})")
    if len(x) != len(y):
        raise ValueError(f"{source}: {x_key} has {len(x)} samples but {y_key} has {len(y)}")
    if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
        bad = int(np.argwhere(~np.isfinite(x.reshape(len(x), -1)))[0, 0])
        raise ValueError(f"{source}: {x_key} has non-finite values (first in sample {bad})")
    if np.issubdtype(x.dtype, np.floating) and x.dtype.itemsize > 4:
        big = np.abs(x.reshape(len(x), -1)) > np.finfo(np.float32).max
        if big.any():
            raise ValueError(f"{source}: {x_key} has values beyond float32's range (first in "
                             f"sample {int(np.argwhere(big)[0, 0])}); scale the features")
    if np.issubdtype(y.dtype, np.floating) and not np.isfinite(y).all():
        raise ValueError(f"{source}: {y_key} has non-finite values")


def class_labels(source: str, key: str, y: np.ndarray, *, tabular: bool = True) -> np.ndarray:
    """`y` as int64 class labels; ValueError naming the key if they are not whole numbers >= 0.
    tabular=False: a source with no regression task (IDX), so the errors do not suggest it."""
    hint = " (use task='regression' for targets)" if tabular else ""
    column_hint = " (is this a label column? use task='regression' for targets)" if tabular else ""
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise ValueError(f"{source}: {key} must be one label per sample, got shape {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        if not np.issubdtype(y.dtype, np.number) or not np.all(np.mod(y, 1) == 0):
            raise ValueError(f"{source}: {key} holds non-integer values ({y.dtype}); class labels "
                             f"must be whole numbers{hint}")
    # before the cast: 2**63 (uint64) wrapped to "negative", 1e30 to anything
    if len(y) and y.max() >= MAX_CLASSES:
        raise ValueError(f"{source}: {key} has label {y.max().item()}; edgefl takes class labels "
                         f"0..{MAX_CLASSES - 1}{column_hint}")
    y = y.astype(np.int64)
    if len(y) and y.min() < 0:
        raise ValueError(f"{source}: {key} has negative label {int(y.min())}")
    return y


# ---------------------------------------------------------------------------------------
# digits (scikit-learn, bundled)
# ---------------------------------------------------------------------------------------

def load_digits() -> Raw:
    """scikit-learn's 1797 8x8 digits (raw 0..16) as (n, 1, 8, 8) images.

    Test split: round(20%) of each class, drawn with the fixed seed DIGITS_SPLIT_SEED = 0
    (1438 train / 359 test).
    Normalised with the training split's scalar pixel mean and std.
    Kept in the data cache (edgefl.data.cache) after the first load, keyed by scikit-learn's
    bundled data file, so later runs do not import scikit-learn at all.
    """
    source = _sklearn_digits_file()
    if source is None:           # scikit-learn missing, or its files laid out otherwise
        return _decode_digits()
    return cached_raw("digits", [source], _decode_digits,
                      {"seed": DIGITS_SPLIT_SEED, "test_fraction": DIGITS_TEST_FRACTION})


def _sklearn_digits_file() -> str | None:
    """scikit-learn's bundled digits file, found without importing scikit-learn."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("sklearn")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            return path
    return None


def _decode_digits() -> Raw:
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as exc:
        raise ImportError("digits needs scikit-learn (pip install 'edgefl[data]')") from exc
    bunch = sklearn_digits()
    x = bunch.images.astype(np.uint8).reshape(-1, 1, 8, 8)   # stored as float64 0..16
    y = bunch.target.astype(np.int64)
    train, test = stratified_split(y, DIGITS_TEST_FRACTION, DIGITS_SPLIT_SEED)
    mean = np.float32(x[train].mean())
    std = np.float32(x[train].std())
    return Raw("digits", x[train], y[train], x[test], y[test], 10, DIGIT_NAMES,
               np.array([mean], np.float32), np.array([std], np.float32), (0, 16))


# ---------------------------------------------------------------------------------------
# MNIST / Fashion-MNIST (IDX files)
# ---------------------------------------------------------------------------------------

_IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
              "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def load_fashion_mnist(*, path: str = FASHION_MNIST_DIR) -> Raw:
    """Fashion-MNIST from IDX files in `path`; per-channel mean 0.2860, std 0.3530 (x255)."""
    return _load_idx_dataset("fashion-mnist", path, FASHION_NAMES, 0.2860, 0.3530,
                             "install Debian's package (apt-get install dataset-fashion-mnist)")


def load_mnist(*, path: str = MNIST_DIR) -> Raw:
    """MNIST from IDX files in `path`; mean 0.1307, std 0.3081 (x255), the usual MNIST
    normalisation (the FedUmf paper, §1, only says "standardized preprocessing")."""
    return _load_idx_dataset("mnist", path, DIGIT_NAMES, 0.1307, 0.3081,
                             "copy the four MNIST IDX files there")


def _load_idx_dataset(name, directory, class_names, mean, std, how_to_get) -> Raw:
    """The four IDX files of `directory`, decoded once and then kept in the data cache
    (edgefl.data.cache) under the files' size and modification time."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"{name}: dataset directory {directory} does not exist; {how_to_get}, or set the "
            f"dataset option path to a directory holding {', '.join(_IDX_FILES)} "
            f"(each may end in .gz)")
    files = []
    for stem in _IDX_FILES:
        found = find_idx(directory, stem)
        if found is None:
            raise FileNotFoundError(f"{name}: no {stem} or {stem}.gz in {directory}")
        files.append(found)
    return cached_raw(name, files,
                      lambda: _decode_idx_dataset(name, files, class_names, mean, std),
                      {"mean": mean, "std": std, "class_names": list(class_names)})


def _decode_idx_dataset(name, files, class_names, mean, std) -> Raw:
    arrays = [(found, read_idx(found)) for found in files]
    (xtr_f, x_train), (ytr_f, y_train), (xte_f, x_test), (yte_f, y_test) = arrays
    for (x_file, x), (y_file, y) in ((arrays[0], arrays[1]), (arrays[2], arrays[3])):
        if x.ndim != 3 or x.dtype != np.uint8:
            raise ValueError(f"{x_file}: expected uint8 images of shape (n, rows, cols), "
                             f"got {x.dtype} {x.shape}")
        if y.ndim != 1:
            raise ValueError(f"{y_file}: expected a 1-D label array, got shape {y.shape}")
        check_arrays(name, x_file, x, y_file, y)
        # any IDX type loads, so labels can be int8 -1 or float 1.5: refused by name, not
        # trained as class -1 or cast to class 1
        y = class_labels(y_file, "labels", y, tabular=False)
        if y.max() >= len(class_names):
            raise ValueError(f"{y_file}: label {int(y.max())} is outside 0..{len(class_names) - 1}")
    if x_test.shape[1:] != x_train.shape[1:]:
        raise ValueError(f"{xte_f}: image shape {x_test.shape[1:]} differs from {xtr_f}'s "
                         f"{x_train.shape[1:]}")
    scale = np.float32(255.0)
    return Raw(name, x_train[:, None], y_train.astype(np.int64), x_test[:, None],
               y_test.astype(np.int64), len(class_names), class_names,
               np.array([mean * scale], np.float32), np.array([std * scale], np.float32), (0, 255))


# ---------------------------------------------------------------------------------------
# CIFAR-10 (binary version)
# ---------------------------------------------------------------------------------------

_CIFAR_TRAIN = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
_CIFAR_TEST = "test_batch.bin"
_CIFAR_RECORD = 1 + 3 * 32 * 32   # label byte + 3 channel planes of 32x32, row-major
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def load_cifar10(*, path: str | None = None) -> Raw:
    """CIFAR-10 binary batches (`data_batch_1..5.bin`, `test_batch.bin`) from `path` or its
    `cifar-10-batches-bin` subdirectory, as (n, 3, 32, 32); the usual per-channel mean/std of
    CIFAR-10 (the FedUmf paper, §1, only says "standardized preprocessing").
    """
    if path is None:
        raise ValueError("cifar10: set the dataset option path to the directory holding the "
                         "CIFAR-10 binary version (data_batch_1.bin .. data_batch_5.bin, "
                         "test_batch.bin)")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"cifar10: dataset directory {path} does not exist; unpack the "
                                f"CIFAR-10 binary version (cifar-10-binary.tar.gz) there")
    sub = os.path.join(path, "cifar-10-batches-bin")
    directory = sub if os.path.isdir(sub) else path
    missing = [f for f in _CIFAR_TRAIN + (_CIFAR_TEST,)
               if not os.path.isfile(os.path.join(directory, f))]
    if missing:
        raise FileNotFoundError(f"cifar10: {directory} lacks {', '.join(missing)}")
    x_train, y_train = _read_cifar_batches([os.path.join(directory, f) for f in _CIFAR_TRAIN])
    x_test, y_test = _read_cifar_batches([os.path.join(directory, _CIFAR_TEST)])
    names = CIFAR10_NAMES
    meta = os.path.join(directory, "batches.meta.txt")
    if os.path.isfile(meta):
        with open(meta, encoding="utf-8") as f:
            listed = tuple(line.strip() for line in f if line.strip())
        names = listed if len(listed) == 10 else names
    scale = np.float32(255.0)
    return Raw("cifar10", x_train, y_train, x_test, y_test, 10, names,
               np.array(CIFAR10_MEAN, np.float32) * scale,
               np.array(CIFAR10_STD, np.float32) * scale,
               (0, 255))


def _read_cifar_batches(files: list[str]) -> tuple[np.ndarray, np.ndarray]:
    records = []
    for file in files:
        data = np.fromfile(file, dtype=np.uint8)
        if data.size == 0 or data.size % _CIFAR_RECORD:
            raise ValueError(f"{file}: {data.size} bytes is not a whole number of "
                             f"{_CIFAR_RECORD}-byte CIFAR-10 records")
        rows = data.reshape(-1, _CIFAR_RECORD)
        if rows[:, 0].max() > 9:
            raise ValueError(f"{file}: label {int(rows[:, 0].max())} is outside 0..9; "
                             f"is this a CIFAR-100 file?")
        records.append(rows)
    rows = np.concatenate(records) if len(records) > 1 else records[0]
    return np.ascontiguousarray(rows[:, 1:]).reshape(-1, 3, 32, 32), rows[:, 0].astype(np.int64)


# ---------------------------------------------------------------------------------------
# a board's own data: npz and csv
# ---------------------------------------------------------------------------------------

_TASKS = ("classification", "regression")
_NORMALISATIONS = ("standard", "none")


def load_npz(*, path: str, x_train: str = "x_train", y_train: str = "y_train",
             x_test: str = "x_test", y_test: str = "y_test", test_fraction: float | None = None,
             split_seed: int = 0, task: str = "classification", num_classes: int | None = None,
             class_names: list | None = None, normalize: str = "standard",
             channels_last: bool = False) -> Raw:
    """Arrays from an .npz file (loaded without pickle); the key options name its arrays.

    x: (n, d) tabular, (n, H, W) one-channel images or (n, C, H, W) images ((n, H, W, C) with
    channels_last). Without test arrays in the file, test_fraction holds out a seeded,
    stratified share of the training arrays. normalize="standard" uses the training set's
    per-channel/per-feature mean and std; "none" keeps the stored values.
    """
    _check_choice("npz", "task", task, _TASKS)
    _check_choice("npz", "normalize", normalize, _NORMALISATIONS)
    path = check_text("npz", "path", path, path=True)
    for key, value in (("x_train", x_train), ("y_train", y_train), ("x_test", x_test),
                       ("y_test", y_test)):
        check_text("npz", key, value)
    class_names = check_class_names("npz", class_names)
    _data_file("npz", path)
    # an .npz is a zip archive; anything else np.load would read as an .npy array or (without
    # pickle) refuse with words about allow_pickle that name neither the file nor the cause
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not an .npz archive (np.savez writes one); its first bytes "
                         f"are not a zip file's")
    try:
        npz = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable .npz archive ({exc})") from None
    with npz:
        stored = set(npz.files)

        def get(key):
            if key not in stored:
                raise ValueError(f"{path}: no array {key!r} (the file holds {sorted(stored)})")
            try:
                return npz[key]
            except (ValueError, zipfile.BadZipFile, OSError) as exc:
                # NumPy's words ("Object arrays cannot be loaded when allow_pickle=False")
                # name neither the file nor the array
                if "Object arrays" in str(exc):
                    raise ValueError(f"{path}: {key} holds Python objects (dtype object), "
                                     f"which are not loaded (no pickle); store numbers") \
                        from None
                raise ValueError(f"{path}: array {key!r} cannot be read ({exc})") from None

        xs, ys = get(x_train), get(y_train)
        has_test = x_test in stored or y_test in stored
        if has_test and test_fraction is not None:
            raise ValueError(f"{path}: holds {x_test!r}/{y_test!r} and test_fraction is set; "
                             f"use one or the other")
        if has_test:
            xt, yt = get(x_test), get(y_test)
        elif test_fraction is None:
            raise ValueError(f"{path}: no test arrays {x_test!r}/{y_test!r} (the file holds "
                             f"{sorted(stored)}); name them or set test_fraction")
    xs = _feature_layout(path, x_train, xs, channels_last)
    check_arrays(path, x_train, xs, y_train, ys)
    if has_test:
        xt = _feature_layout(path, x_test, xt, channels_last)
        check_arrays(path, x_test, xt, y_test, yt)
        if xt.shape[1:] != xs.shape[1:]:
            raise ValueError(f"{path}: {x_test} has per-sample shape {xt.shape[1:]} but "
                             f"{x_train} has {xs.shape[1:]}")
    else:
        train, test = stratified_split(_labels_for_split(ys, task, path, y_train), test_fraction,
                                       split_seed, "npz")
        xs, ys, xt, yt = xs[train], ys[train], xs[test], ys[test]
    raw = _tabular_raw("npz", path, xs, ys, xt, yt, (y_train, y_test), task, num_classes,
                       class_names, normalize)
    return dataclasses.replace(raw, private=True)     # np.load made these arrays


def load_csv(*, path: str, label: str | int = "label", test_path: str | None = None,
             test_fraction: float | None = None, split_seed: int = 0, delimiter: str = ",",
             task: str = "classification", num_classes: int | None = None,
             class_names: list | None = None, normalize: str = "standard") -> Raw:
    """Tabular data from a CSV file: one label column (header name or 0-based index, negative
    counts from the end) and numeric feature columns. The first row is a header if any of its
    cells is not a number. The test set comes from test_path (same columns) or a seeded,
    stratified test_fraction of the file (default 0.2 when test_path is not given).
    """
    _check_choice("csv", "task", task, _TASKS)
    _check_choice("csv", "normalize", normalize, _NORMALISATIONS)
    path = check_text("csv", "path", path, path=True)
    if test_path is not None:
        test_path = check_text("csv", "test_path", test_path, path=True)
    if not isinstance(delimiter, str) or len(delimiter) != 1:
        raise ValueError(f"csv: delimiter must be one character, got {delimiter!r}")
    if isinstance(label, bool) or not isinstance(label, (str, int)):
        raise ValueError(f"csv: label must be a column's name or index, got {label!r}")
    class_names = check_class_names("csv", class_names)
    if test_path is not None and test_fraction is not None:
        raise ValueError("csv: set test_path or test_fraction, not both")
    label_key = f"label column {label!r}"
    header, table, lines = read_csv_table(path, delimiter)
    column = _label_column(path, header, label, table.shape[1])
    _finite_cells(path, header, table, lines, column, label_key)
    xs, ys = np.delete(table, column, axis=1), table[:, column]
    if test_path is not None:
        test_header, test_table, test_lines = read_csv_table(test_path, delimiter)
        if test_table.shape[1] != table.shape[1] or (header and test_header != header):
            raise ValueError(f"{test_path}: columns {test_header or test_table.shape[1]} differ "
                             f"from {path}'s {header or table.shape[1]}")
        _finite_cells(test_path, header, test_table, test_lines, column, label_key)
        xt, yt = np.delete(test_table, column, axis=1), test_table[:, column]
    else:
        y_split = _labels_for_split(ys, task, path, label_key)
        train, test = stratified_split(y_split, 0.2 if test_fraction is None else test_fraction,
                                       split_seed, "csv")
        xs, ys, xt, yt = xs[train], ys[train], xs[test], ys[test]
    check_arrays(path, "features", xs, label_key, ys)
    check_arrays(test_path or path, "test features", xt, label_key, yt)
    return _tabular_raw("csv", path, xs, ys, xt, yt, (label_key, label_key), task, num_classes,
                        class_names, normalize)


def _check_choice(source, key, value, choices):
    if value not in choices:
        raise ValueError(f"{source}: {key}={value!r}; valid: {', '.join(choices)}")


def _feature_layout(path, key, x, channels_last):
    """x as (n, d) or (n, C, H, W)."""
    if x.ndim == 2:
        return x
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 4:
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2)) if channels_last else x
    raise ValueError(f"{path}: {key} has shape {x.shape}; expected (n, d), (n, H, W) or "
                     f"(n, C, H, W)")


def _labels_for_split(y, task, source, key):
    """The array stratified_split should stratify on: class labels, or float targets."""
    if task == "classification":
        return class_labels(source, key, y)
    if not np.issubdtype(y.dtype, np.number):    # else NumPy's "could not convert string"
        raise ValueError(f"{source}: regression targets {key} must be numeric, got {y.dtype}")
    return np.asarray(y, dtype=np.float64)


def _tabular_raw(name, path, xs, ys, xt, yt, y_keys, task, num_classes, class_names, normalize):
    if not np.issubdtype(xs.dtype, np.number) or not np.issubdtype(xt.dtype, np.number):
        raise ValueError(f"{path}: features must be numeric, got {xs.dtype}")
    if task == "classification":
        ys, yt = class_labels(path, y_keys[0], ys), class_labels(path, y_keys[1], yt)
        seen = int(max(ys.max(), yt.max())) + 1
        if num_classes is None:
            num_classes = len(class_names) if class_names else seen
        elif check_real(name, "num_classes", num_classes, integer=True) < 1:
            raise ValueError(f"{name}: num_classes must be a positive integer, "
                             f"got {num_classes!r}")
        elif num_classes > MAX_CLASSES:
            raise ValueError(f"{name}: num_classes must be 1..{MAX_CLASSES}, got {num_classes}")
        for key, y in zip(y_keys, (ys, yt)):
            if y.max() >= num_classes:
                raise ValueError(f"{path}: {key}: label {int(y.max())} is outside "
                                 f"0..{num_classes - 1} (num_classes={num_classes})")
        names = tuple(class_names) if class_names else tuple(str(i) for i in range(num_classes))
        if len(names) != num_classes:
            raise ValueError(f"{path}: {len(names)} class_names for {num_classes} classes")
    else:
        if not np.issubdtype(ys.dtype, np.number) or not np.issubdtype(yt.dtype, np.number):
            raise ValueError(f"{path}: regression targets {y_keys[0]} must be numeric, "
                             f"got {ys.dtype}")
        if ys.ndim not in (1, 2) or yt.shape[1:] != ys.shape[1:]:
            raise ValueError(f"{path}: regression targets must have shape (n,) or (n, k) in "
                             f"both splits, got {y_keys[0]} {ys.shape} and {y_keys[1]} {yt.shape}")
        for key, y in zip(y_keys, (ys, yt)):     # finish() makes them float32: inf
            big = np.abs(y.reshape(len(y), -1)) > np.finfo(np.float32).max
            if big.any():
                raise ValueError(f"{path}: {key} has values beyond float32's range (first in "
                                 f"sample {int(np.argwhere(big)[0, 0])}); scale the targets")
        num_classes, names = 0, ()
    if normalize == "standard":
        mean, std = standardisation(xs)
    else:
        channels = xs.shape[1] if xs.ndim in (2, 4) else 1
        mean, std = np.zeros(channels, np.float32), np.ones(channels, np.float32)
    return Raw(name, xs, ys, xt, yt, num_classes, names, mean, std,
               (float(xs.min()), float(xs.max())))


def read_csv_table(path: str, delimiter: str = ",") -> tuple[list | None, np.ndarray, list]:
    """(header or None, float64 table, each row's line number) of a CSV file of numbers, the
    one CSV reader (the `csv` data set, `edgefl predict --input x.csv`): blank lines are
    skipped, a first row that is not all numbers is the header. ValueError naming the file,
    line and column (not UTF-8, a cell that is no number, a row of another width, no data
    rows); FileNotFoundError when there is no such file."""
    _data_file("csv", path)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = [(n, row) for n, row in enumerate(csv.reader(f, delimiter=delimiter), start=1)
                    if any(cell.strip() for cell in row)]
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
                         f"offset {exc.start})") from None
    if not rows:
        raise ValueError(f"{path}: the file is empty")
    header = None
    if not all(_is_numeric_text(cell) for cell in rows[0][1]):
        header = [cell.strip() for cell in rows[0][1]]
        rows = rows[1:]
    if not rows:
        raise ValueError(f"{path}: the file has a header but no data rows")
    width = len(header) if header else len(rows[0][1])
    for line, row in rows:
        if len(row) != width:
            raise ValueError(f"{path}: line {line} has {len(row)} columns, expected {width}")
    try:
        return header, np.array([row for _, row in rows], dtype=np.float64), \
            [line for line, _ in rows]
    except ValueError:
        for line, row in rows:
            for col, cell in enumerate(row):
                if not _is_numeric_text(cell):
                    name = header[col] if header else col
                    raise ValueError(f"{path}: line {line}, column {name!r}: {cell!r} is not a "
                                     f"number") from None
        raise


def _finite_cells(path, header, table, lines, column, label_key) -> None:
    """ValueError naming the line and column of the first nan or inf cell: float() reads
    them as numbers, and check_arrays, after the split, could only say "sample k" of the
    shuffled training rows, which is no line of the file."""
    for bad, problem in ((~np.isfinite(table), "non-finite values"),
                         (np.abs(table) > np.finfo(np.float32).max,
                          "values beyond float32's range")):
        if bad.any():
            row, col = (int(i) for i in np.argwhere(bad)[0])
            what = label_key if col == column else "features"
            name = header[col] if header else col
            raise ValueError(f"{path}: {what} has {problem} (line {lines[row]}, column "
                             f"{name!r}: {table[row, col]})")


def _data_file(kind: str, path) -> None:
    """FileNotFoundError if `path` does not exist; ValueError if it is a directory (an
    existing path called missing sent users looking for a typo)."""
    if os.path.isdir(path):
        raise ValueError(f"{kind}: {path} is a directory, not a .{kind} file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{kind}: file {path} does not exist")


def _is_numeric_text(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def _label_column(path, header, label, width) -> int:
    if isinstance(label, str):
        if header is None:
            raise ValueError(f"{path}: has no header row, so label={label!r} cannot be found; "
                             f"give the label column's index instead")
        if label not in header:
            raise ValueError(f"{path}: no column named {label!r}; columns: {', '.join(header)}")
        named = [col for col, name in enumerate(header) if name == label]
        if len(named) > 1:           # the first of them was taken, silently
            raise ValueError(f"{path}: the header names column {label!r} {len(named)} times "
                             f"(columns {', '.join(map(str, named))}); give the label column "
                             f"a name of its own, or its index as label")
        return named[0]
    if isinstance(label, bool) or not isinstance(label, int) or not -width <= label < width:
        raise ValueError(f"{path}: label={label!r} is not a column name or an index in "
                         f"{-width}..{width - 1}")
    if width < 2:
        raise ValueError(f"{path}: needs a label column and at least one feature column")
    return label % width


# ---------------------------------------------------------------------------------------
# synthetic(alpha, beta)
# ---------------------------------------------------------------------------------------

def load_synthetic(*, alpha: float = 0.0, beta: float = 0.0, dim: int = 30, classes: int = 5,
                   clients: int = 20, samples_per_client: int = 200, size_sigma: float = 0.0,
                   test_fraction: float = 0.2, seed: int = 0) -> Raw:
    """Synthetic(alpha, beta), the FedProx-style softmax-regression data of FedUmf's appendix
    (the FedUmf paper's Appendix A follows FedDC, Gao et al. CVPR 2022, whose code's
    generator this is: dim 30, 5 classes, 20 clients, ~200 samples per client).

    Client k draws n_k ~ LogNormal(log(samples_per_client), size_sigma) samples
    x ~ N(v_k, Sigma), Sigma = diag(j^-1.2), labelled y = argmax(x W_k + b_k).
    alpha spreads the client optima: W_k, b_k ~ N(u_k, 1) with u_k ~ N(0, alpha); at alpha = 0
    all clients share one W, b ~ N(0, 1). beta spreads the inputs: v_k ~ N(B_k, 1) per
    coordinate with B_k ~ N(0, beta); at beta = 0 every v_k = 0. So (0, 0) is homogeneous, as
    the FedDC code's iid_sol/iid_data flags make it.
    Each client also draws test_fraction/(1 - test_fraction) * n_k held-out samples from its own
    distribution; the test set pools them (FedDC tests on the training data; we do not).
    `client_ids` records each training sample's client, for the `natural` partition.
    Features are left unnormalised.
    """
    for key, value in (("dim", dim), ("classes", classes), ("clients", clients),
                       ("samples_per_client", samples_per_client)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"synthetic: {key} must be a positive integer, got {value!r}")
    if classes < 2:
        raise ValueError(f"synthetic: classes must be at least 2, got {classes}")
    for key, value in (("alpha", alpha), ("beta", beta), ("size_sigma", size_sigma)):
        if not check_real("synthetic", key, value) >= 0:
            raise ValueError(f"synthetic: {key} must be >= 0, got {value!r}")
    alpha, beta, size_sigma = float(alpha), float(beta), float(size_sigma)
    seed = check_seed("synthetic", "seed", seed)
    test_fraction = check_real("synthetic", "test_fraction", test_fraction)
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"synthetic: test_fraction must be in [0, 1), got {test_fraction!r}")
    rng = np.random.default_rng(seed)
    scale = np.power(np.arange(1, dim + 1, dtype=np.float64), -1.2) ** 0.5   # sqrt(diag(Sigma))
    sizes = rng.lognormal(np.log(samples_per_client + 1e-3), size_sigma, clients).astype(int)
    sizes = np.maximum(sizes, 1)
    test_sizes = np.floor(sizes * test_fraction / (1.0 - test_fraction) + 0.5).astype(int)
    opt_means = rng.normal(0.0, alpha, clients)
    input_means = np.zeros((clients, dim))
    if beta > 0:
        input_means = rng.normal(rng.normal(0.0, beta, clients)[:, None], 1.0, (clients, dim))
    w = rng.normal(0.0, 1.0, (dim, classes))
    b = rng.normal(0.0, 1.0, classes)
    parts = {"x_train": [], "y_train": [], "x_test": [], "y_test": []}
    for k in range(clients):
        if alpha > 0:
            w = rng.normal(opt_means[k], 1.0, (dim, classes))
            b = rng.normal(opt_means[k], 1.0, classes)
        x = input_means[k] + rng.standard_normal((sizes[k] + test_sizes[k], dim)) * scale
        y = np.argmax(x @ w + b, axis=1)
        parts["x_train"].append(x[:sizes[k]])
        parts["y_train"].append(y[:sizes[k]])
        parts["x_test"].append(x[sizes[k]:])
        parts["y_test"].append(y[sizes[k]:])
    xs, ys, xt, yt = (np.concatenate(parts[k]) for k in ("x_train", "y_train", "x_test", "y_test"))
    if len(yt) == 0:
        raise ValueError("synthetic: test_fraction leaves no test samples; raise test_fraction")
    owners = np.repeat(np.arange(clients, dtype=np.int32), sizes)
    return Raw("synthetic", xs, ys.astype(np.int64), xt, yt.astype(np.int64), classes,
               tuple(str(c) for c in range(classes)), np.zeros(1, np.float32),
               np.ones(1, np.float32), (float(xs.min()), float(xs.max())), client_ids=owners)
