"""A partition laid out for training: every client's shard one contiguous block of rows.

`contiguous(dataset, split)` reorders the training set's rows in place so that shard 0's
samples come first, then shard 1's, ..., each shard in its own index order, and returns the
reordered Dataset with the same split re-expressed as offsets into it (`partition.Shards`).
A client's x and y are then slices -- views -- of the one training array: no per-client copy,
and the same rows in the same order as `x_train[indices]` gave, so training (and the final
model) is bit for bit what it was with copies. The reorder is a cycle walk with a bounded
buffer (`permute_rows`), so the training set is never held twice, not even for a moment.

A split whose shards are not a permutation of the training set (a hand-made Partition that
leaves rows out or repeats them) is laid out by gathering into a new array instead. Tiled
splits (`partition(..., tile=t)`) lay out their shards once; clients share them.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .datasets import Dataset
from .partition import Partition, Shards, Tiled

__all__ = ["contiguous", "permute_rows", "without_training_rows"]

_CHUNK_BYTES = 1 << 20        # the buffer of one step of a cycle walk (fits a cache)


def permute_rows(x: np.ndarray, order: np.ndarray) -> None:
    """x[i] = (x before)[order[i]] for every row i, in place; `order` a permutation of
    range(len(x)). Each cycle of the permutation is walked in steps of a few thousand rows
    (one fancy-indexed copy each: the right-hand side is read whole before it is written),
    so the extra memory is one step's rows, not a second array."""
    n = len(x)
    order = np.asarray(order, dtype=np.int64)
    if order.shape != (n,):
        raise ValueError(f"permute_rows: {order.shape} order for {n} rows")
    if not x.flags.c_contiguous or not x.flags.writeable:
        raise ValueError("permute_rows: x must be a writable C-contiguous array")
    row_bytes = max(1, x.itemsize * (x.size // n if n else 1))
    step = max(1, _CHUNK_BYTES // row_bytes)
    following = order.tolist()
    seen = bytearray(n)
    for start in range(n):
        if seen[start]:
            continue
        seen[start] = 1
        nxt = following[start]
        if nxt == start:
            continue
        cycle = [start]
        while nxt != start:
            seen[nxt] = 1
            cycle.append(nxt)
            nxt = following[nxt]
        cycle = np.array(cycle, dtype=np.int64)
        first = x[cycle[0]].copy()        # x[c_k] <- x[c_k+1], and the last <- the first
        last = len(cycle) - 1
        for a in range(0, last, step):
            b = min(a + step, last)
            x[cycle[a:b]] = x[cycle[a + 1:b + 1]]
        x[cycle[last]] = first


def contiguous(dataset: Dataset, split: Partition) -> tuple[Dataset, Partition]:
    """(the dataset with its training rows reordered shard by shard, the split as offsets
    into it). The returned Dataset's x_train is `dataset.x_train` itself, reordered in place
    when it can be (writable, C-contiguous, and the shards a permutation of its rows); the
    caller must not use `dataset` afterwards. y_train and the per-sample extras are
    reordered copies (small); a label-noise split's labels become one array, sliced alike."""
    tiled = isinstance(split.indices, Tiled)
    shards = split.indices.base if tiled else split.indices
    labels = split.labels.base if tiled and split.labels is not None else split.labels
    if isinstance(shards, Shards):
        order, offsets = shards.order, shards.offsets
    else:
        sizes = np.fromiter((len(i) for i in shards), dtype=np.int64, count=len(shards))
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        order = np.concatenate(list(shards)).astype(np.int64) if len(shards) else \
            np.zeros(0, np.int64)
    n = len(dataset.x_train)
    x = dataset.x_train
    is_permutation = len(order) == n and (n == 0 or (
        order.min() >= 0 and order.max() < n
        and np.all(np.bincount(order, minlength=n) == 1)))
    if is_permutation and x.flags.c_contiguous and x.flags.writeable:
        if not np.array_equal(order, np.arange(n)):
            permute_rows(x, order)
    else:
        x = np.ascontiguousarray(x[order])

    def reorder(a):
        return None if a is None else np.ascontiguousarray(a[order])

    laid = dataclasses.replace(dataset, x_train=x, y_train=reorder(dataset.y_train),
                               client_ids=reorder(dataset.client_ids),
                               y_train_original=reorder(dataset.y_train_original),
                               train_rows=order if dataset.train_rows is None
                               else dataset.train_rows[order])
    layout = Shards(np.arange(len(order), dtype=np.int64), offsets)
    noisy = None
    if labels is not None:       # label-noise: each client's own labels, laid out alike
        noisy = Shards(np.ascontiguousarray(np.concatenate(list(labels))), offsets)
    if tiled:
        return laid, Partition(Tiled(layout, len(split.indices)),
                               None if noisy is None else Tiled(noisy, len(split.indices)))
    return laid, Partition(layout, noisy)


def without_training_rows(dataset: Dataset, keep: int) -> Dataset:
    """The dataset with only the source's first `keep` training samples (`first_train`: what
    an int8 export calibrates on) and the whole test set: what a run needs once its rounds
    are over, so its training set can be freed before the outputs load their libraries."""
    x = np.ascontiguousarray(dataset.first_train(keep))
    if dataset.train_rows is None:
        rows = np.arange(len(x))
    else:
        values, first = np.unique(dataset.train_rows, return_index=True)
        rows = first[values < keep]

    def head(a):
        return None if a is None else np.ascontiguousarray(a[rows])

    return dataclasses.replace(dataset, x_train=x, y_train=head(dataset.y_train),
                               client_ids=head(dataset.client_ids),
                               y_train_original=head(dataset.y_train_original),
                               train_rows=None)
