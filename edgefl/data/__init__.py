"""The data layer: datasets by name, and partitions of their training sets among clients.

    ds = load_dataset("digits", limit_train=500)
    split = partition(ds, "dirichlet", n_clients=10, seed=0, alpha=0.3)

See docs/data.md for every dataset, option and partitioner.
"""
from __future__ import annotations

import inspect
import os

import numpy as np

from .datasets import (
    FASHION_MNIST_DIR,
    MNIST_DIR,
    Dataset,
    check_seed,
    finish,
    load_cifar10,
    load_csv,
    load_digits,
    load_fashion_mnist,
    load_mnist,
    load_npz,
    load_synthetic,
)
from .partition import PARTITIONERS, Partition, tile

LOADERS = {
    "digits": load_digits,
    "mnist": load_mnist,
    "fashion-mnist": load_fashion_mnist,
    "cifar10": load_cifar10,
    "npz": load_npz,
    "csv": load_csv,
    "synthetic": load_synthetic,
}
COMMON_OPTIONS = ("limit_train", "limit_test", "binary")   # taken by every dataset (see finish)
# taken by every partitioner (see partition): `tile: t` splits the training set among
# clients / t shards and gives client c shard c mod (clients / t), so t clients share each
# shard -- a large simulated fleet over a small data set (docs/scaling.md), without a copy
PARTITION_COMMON = ("tile",)

# Partitioners that split by class; on a relabelled dataset (binary="even-odd") they use the
# original classes, as MFL's Case 2 assigns node = original digit mod N (Liu et al. 2020, Sec. 7.2).
_BY_ORIGINAL_CLASS = ("shards", "dirichlet", "mod")

__all__ = ["Dataset", "Partition", "LOADERS", "PARTITIONERS", "COMMON_OPTIONS", "load_dataset",
           "partition", "dataset_options", "partition_options", "dataset_status"]


def dataset_options(name: str) -> tuple[str, ...]:
    """The option names `load_dataset(name, ...)` accepts."""
    return _options(LOADERS, "dataset", name) + COMMON_OPTIONS


def partition_options(name: str) -> tuple[str, ...]:
    """The option names `partition(..., name, ...)` accepts."""
    return _options(PARTITIONERS, "partition", name) + PARTITION_COMMON


def load_dataset(name: str, **options) -> Dataset:
    """Load dataset `name` (one of LOADERS) with its options plus limit_train, limit_test and
    binary; unknown names and option keys raise ValueError listing the valid ones."""
    valid = dataset_options(name)
    _reject_unknown("dataset", name, options, valid)
    loader = LOADERS[name]
    _require(loader, "dataset", name, options)
    common = {k: options.pop(k) for k in COMMON_OPTIONS if k in options}
    return finish(loader(**options), **common)


def partition(dataset_or_labels, name: str, n_clients: int, seed: int, **options) -> Partition:
    """Split a Dataset's training set (or a label array) among `n_clients` with partitioner
    `name`, drawing from np.random.default_rng(seed). Dataset facts a partitioner needs
    (natural owners, the class count for label-noise) are filled in from the Dataset."""
    _reject_unknown("partition", name, options, partition_options(name))
    fn = PARTITIONERS[name]
    if isinstance(dataset_or_labels, Dataset):
        ds = dataset_or_labels
        labels = ds.y_train
        if name in _BY_ORIGINAL_CLASS and ds.y_train_original is not None:
            labels = ds.y_train_original
        if name == "natural":
            options.setdefault("owners", ds.client_ids)
        if name == "label-noise" and ds.num_classes:
            options.setdefault("num_classes", ds.num_classes)
    else:
        labels = np.asarray(dataset_or_labels)
    seed = check_seed("partition", "seed", seed)     # NumPy's words named no option
    times = options.pop("tile", 1)
    if isinstance(times, bool) or not isinstance(times, (int, np.integer)) or times < 1:
        raise ValueError(f"partition: tile must be a positive integer, got {times!r}")
    if times == 1:
        return fn(labels, n_clients, np.random.default_rng(seed), **options)
    # checked here, not by the partitioner: it is given clients // tile, so 1e6 was "got
    # 1000.0" and -1000 "got -1"
    if isinstance(n_clients, bool) or not isinstance(n_clients, (int, np.integer)) \
            or n_clients < 1:
        raise ValueError(f"partition: clients must be a positive integer, got {n_clients!r}")
    if n_clients % times:
        raise ValueError(f"partition: tile = {times} does not divide clients = {n_clients} "
                         f"(each of the clients / tile shards is held by tile clients)")
    try:
        split = fn(labels, n_clients // times, np.random.default_rng(seed), **options)
    except ValueError as exc:
        # the partitioner's "clients" are the shards: say so, or "iid: 2000 clients but only
        # 1000 training samples" answers a request for 2,000,000 clients
        raise ValueError(f"partition: clients = {n_clients} with tile = {times} splits the "
                         f"data into {n_clients // times} shards, each shared by {times} "
                         f"clients: {exc}") from None
    return tile(split, n_clients)


def dataset_status() -> dict[str, str]:
    """One line per dataset saying whether it can be loaded here without options."""
    # the installed version from its metadata: importing scikit-learn takes over a second
    from importlib import metadata
    try:
        digits = f"available (scikit-learn {metadata.version('scikit-learn')})"
    except metadata.PackageNotFoundError:
        digits = "needs scikit-learn (pip install 'edgefl[data]')"

    def directory(path, how):
        return f"available in {path}" if os.path.isdir(path) else f"not in {path} ({how})"

    return {
        "digits": digits,
        "mnist": directory(MNIST_DIR, "copy the IDX files there or set path"),
        "fashion-mnist": directory(FASHION_MNIST_DIR, "apt-get install dataset-fashion-mnist"),
        "cifar10": "needs path (directory of the CIFAR-10 binary batches)",
        "npz": "needs path (your .npz file)",
        "csv": "needs path (your .csv file)",
        "synthetic": "available (generated)",
    }


def _options(registry: dict, kind: str, name: str) -> tuple[str, ...]:
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(registry)}")
    params = inspect.signature(registry[name]).parameters.values()
    return tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY)


def _reject_unknown(kind: str, name: str, options: dict, valid: tuple) -> None:
    unknown = [k for k in options if k not in valid]
    if unknown:
        raise ValueError(f"{kind} {name!r}: unknown option {unknown[0]!r}; valid options: "
                         f"{', '.join(valid) or '(none)'}")


def _require(fn, kind: str, name: str, options: dict) -> None:
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty and p.name not in options:
            raise ValueError(f"{kind} {name!r}: option {p.name!r} is required")
