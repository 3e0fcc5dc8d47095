"""Aggregation math, free functions over flat buffers: the weights of a round's updates
(exact ratios, rounded once), their float64 weighted average in sorted client order, and
the mean training loss; and the two halves of a server step from a sum (secure aggregation,
DP): a client's delta and weight, and the mean delta applied to the server's buffers."""
from __future__ import annotations

from fractions import Fraction
from typing import Mapping, Sequence

import numpy as np

from .. import kernels
from ._types import Contribution, StrategyError, SumTotal, Task, Update

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


def update_buffers(updates: Mapping[int, Update], name: str, clients: Sequence[int]) -> list:
    """Buffer `name` of each of `clients`' updates (in that order); a board's upload may name
    its buffers anything, so a missing one is a StrategyError naming the clients (which the
    aggregator refuses alone), not a KeyError that fails the round."""
    missing = [c for c in clients if name not in updates[c].buffers]
    if missing:
        raise StrategyError(f"aggregate: update of client(s) {missing} has no {name!r} buffer "
                            f"(got {sorted(updates[missing[0]].buffers)})")
    return [updates[c].buffers[name] for c in clients]


def number_scalars(strategy: str, updates: Mapping[int, Update], key: str,
                   clients: Sequence[int]) -> dict:
    """{client: float(scalar `key`)} of `clients`' updates. Scalars arrive as any JSON value;
    one missing or not a number (NaN and infinities are numbers: the strategy says what they
    mean) is a StrategyError naming the clients, which the aggregator refuses alone, where
    float() of a list or None raised a TypeError that failed the round."""
    bad = {c: updates[c].scalars.get(key) for c in clients
           if isinstance(updates[c].scalars.get(key), bool)
           or not isinstance(updates[c].scalars.get(key), (int, float))}
    if bad:
        raise StrategyError(f"{strategy}: update of client(s) {sorted(bad)} lacks the {key!r} "
                            f"scalar or it is not a number (got "
                            f"{', '.join(repr(v) for v in bad.values())})")
    return {c: float(updates[c].scalars[key]) for c in clients}


def average_updates(updates: Mapping[int, Update], name: str, clients: Sequence[int],
                    weights) -> np.ndarray:
    """weighted_average of buffer `name` over `clients` (in that order)."""
    return weighted_average(update_buffers(updates, name, clients), weights)


def mean_train_loss(updates: Mapping[int, Update]) -> float:
    """Mean minibatch loss over all local steps of the uploaded updates
    (for FedUmf, over the authorised clients' steps only: the others upload nothing)."""
    steps = sum(u.steps for u in updates.values())
    if not steps:
        return float("nan")
    return sum(u.train_loss * u.steps for _, u in sorted(updates.items())) / steps


# --------------------------------------------------------------------------- sums
def client_weight(update: Update, weighting: str) -> int:
    """The whole-number weight a contribution carries: |D_i| (samples) or 1 (uniform); the
    server divides by their sum, so this is `exact_weights` without the common denominator."""
    if weighting == "uniform":
        return 1
    if weighting != "samples":
        raise StrategyError(f"weighting {weighting!r}; valid: {', '.join(WEIGHTINGS)}")
    return update.num_samples


def update_delta(task: Task, update: Update, names: Sequence[str]) -> np.ndarray:
    """The deltas update.buffers[name] - task.buffers[name], end to end in `names` order
    (float32, one rounding each): what a contribution's vector is made of."""
    missing = [n for n in names if n not in update.buffers or n not in task.buffers]
    if missing:
        raise StrategyError(f"contribution: buffer(s) {missing} missing from the update "
                            f"(has {sorted(update.buffers)}) or the task (has {sorted(task.buffers)})")
    parts = [np.subtract(update.buffers[n], task.buffers[n]) for n in names]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def contribution_of(task: Task, update: Update, names: Sequence[str], weighting: str,
                    **scalars) -> Contribution:
    """The usual contribution: the deltas of buffers `names`, weighted by `weighting`."""
    if not task.upload:
        raise StrategyError(f"contribution: round {task.round}'s task allows no upload")
    return Contribution(update_delta(task, update, names), client_weight(update, weighting),
                        scalars)


def mean_delta(total: SumTotal, size: int) -> np.ndarray:
    """sum_i w_i delta_i / sum_i w_i in float64, checked against the expected `size`."""
    if total.vector.size != size:
        raise StrategyError(f"aggregate_sum: the sum has {total.vector.size} values, the "
                            f"server's buffers {size}")
    if not total.weight > 0:
        raise StrategyError(f"aggregate_sum: total weight {total.weight} cannot weight an "
                            f"average (no contribution, or all of weight 0)")
    return np.divide(total.vector, float(total.weight), dtype=np.float64)


def apply_mean_delta(buffers: Mapping[str, np.ndarray], names: Sequence[str],
                     total: SumTotal, factor: float = 1.0) -> dict:
    """{name: buffer + factor * (its part of the mean delta)}, in float64 rounded once to
    float32: the server step of FedAvg (factor 1) and, with its tau_eff, FedNova."""
    sizes = [buffers[n].size for n in names]
    mean = mean_delta(total, sum(sizes))
    if factor != 1.0:
        mean *= factor
    out, at = {}, 0
    for name, size in zip(names, sizes):
        # float64 sum rounded once into the float32 result, without float64 temporaries
        result = np.empty(buffers[name].shape, np.float32)
        np.add(buffers[name], mean[at:at + size].reshape(buffers[name].shape), out=result,
               dtype=np.float64, casting="same_kind")
        out[name] = result
        at += size
    return out
