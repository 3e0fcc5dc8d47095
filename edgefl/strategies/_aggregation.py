"""Aggregation math, free functions over flat buffers: the weights of a round's updates
(exact ratios, rounded once), their float64 weighted average in sorted client order, and
the mean training loss."""
from __future__ import annotations

from fractions import Fraction
from typing import Mapping, Sequence

import numpy as np

from .. import kernels
from ._types import StrategyError, Update

WEIGHTINGS = ("samples", "uniform")


def _weight_parts(updates: Mapping[int, Update], weighting: str):
    """(sorted client ids, numerators, denominator) of the aggregation weights."""
    clients = sorted(updates)
    if not clients:
        raise StrategyError("aggregate: no updates to aggregate")
    if weighting == "uniform":
        return clients, [1] * len(clients), len(clients)
    if weighting != "samples":
        raise StrategyError(f"weighting {weighting!r}; valid: {', '.join(WEIGHTINGS)}")
    counts = [updates[c].num_samples for c in clients]
    total = sum(counts)
    if total <= 0 or min(counts) < 0:
        raise StrategyError(f"aggregate: sample counts {counts} cannot weight an average")
    return clients, counts, total


def exact_weights(updates: Mapping[int, Update], weighting: str = "samples"):
    """(sorted client ids, exact rational weights summing to exactly 1).

    samples: p_i = |D_i| / sum_j |D_j| (FedAvg, McMahan et al. 2017; MFL (8)-(9)).
    uniform: p_i = 1 / K (FedUmf's plain average of the authorised clients).
    """
    clients, nums, den = _weight_parts(updates, weighting)
    return clients, [Fraction(n, den) for n in nums]


def aggregation_weights(updates: Mapping[int, Update], weighting: str = "samples"):
    """(sorted client ids, float64 weights) of `exact_weights`. Each weight is the correctly
    rounded value of the exact ratio, so strategies that agree mathematically on the weights
    (FedNova with equal tau, MFL with gamma = 0, FedUmf with alpha = 0) agree bit for bit.
    (CPython's int / int is correctly rounded: the same float as float(Fraction(n, d)),
    without building the Fraction.)"""
    clients, nums, den = _weight_parts(updates, weighting)
    return clients, np.array([n / den for n in nums])


def weighted_average(buffers: Sequence[np.ndarray], weights) -> np.ndarray:
    """A new buffer sum_k weights[k] * buffers[k]: one streaming pass over K separate
    buffers, float64 accumulation in k order, one rounding to float32 (kernels.weighted_sum)."""
    buffers = list(buffers)
    if not buffers:
        raise StrategyError("weighted_average: no buffers")
    out = np.empty_like(buffers[0])
    kernels.weighted_sum(out, buffers, weights)
    return out


def average_updates(updates: Mapping[int, Update], name: str, clients: Sequence[int],
                    weights) -> np.ndarray:
    """weighted_average of buffer `name` over `clients` (in that order)."""
    missing = [c for c in clients if name not in updates[c].buffers]
    if missing:
        raise StrategyError(f"aggregate: update of client(s) {missing} has no {name!r} buffer "
                            f"(got {sorted(updates[missing[0]].buffers)})")
    return weighted_average([updates[c].buffers[name] for c in clients], weights)


def mean_train_loss(updates: Mapping[int, Update]) -> float:
    """Mean minibatch loss over all local steps of the uploaded updates
    (for FedUmf, over the authorised clients' steps only: the others upload nothing)."""
    steps = sum(u.steps for u in updates.values())
    if not steps:
        return float("nan")
    return sum(u.train_loss * u.steps for _, u in sorted(updates.items())) / steps
