"""FedNova: Wang, Liu, Liang, Joshi, Poor, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization", NeurIPS 2020 (arXiv 2007.07481), §4 "FedNova".

When clients take different numbers of local steps tau_i, FedAvg's average drifts towards
the objective of the clients that ran longest. FedNova averages *normalised* updates instead.
Client i's local round is w_i = w - eta G_i a_i (G_i stacks its local gradients, a_i the
optimiser's aggregation vector); the server sets

    w <- w - tau_eff * sum_i p_i (w - w_i) / ||a_i||_1,    tau_eff = sum_i p_i ||a_i||_1

For plain SGD a_i = (1, ..., 1) and ||a_i||_1 = tau_i, so

    w <- w - tau_eff * sum_i p_i (w - w_i) / tau_i,        tau_eff = sum_i p_i tau_i.

With local heavy-ball momentum rho (d = rho d + g; w -= eta d, the kernels' convention) the
paper's a_i has entries (1 - rho^k) / (1 - rho), k = tau_i..1, so
||a_i||_1 = sum_{k=1}^{tau_i} (1 - rho^k) / (1 - rho); it is accumulated here exactly as the
authors' code does (counter = rho * counter + 1; norm += counter).

p_i = |D_i| / sum |D_j| (weighting: samples, the paper's default) or 1/K (uniform).

Implementation: the update is the single weighted sum

    w_new = sum_i c_i w_i + (1 - sum_i c_i) w,    c_i = p_i tau_eff / ||a_i||_1,

with the c_i computed in exact rational arithmetic and rounded once. With equal tau_i every
c_i is exactly p_i and the residual weight exactly 0, so FedNova reproduces FedAvg bit for
bit (the server model then drops out of the sum).

`robust` (strategies/robust.py, an extension) applies its rule to the normalised updates
(w_i - w) / ||a_i||_1 and scales the result by tau_eff over the accepted clients; with the
mean rule and nothing rejected or clipped it is the sum above, bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from . import (WEIGHTINGS, Contribution, Strategy, StrategyError, Update, apply_mean_delta,
               check_choice, client_weight, exact_weights, extension_field, local_round,
               mean_delta, mean_train_loss, register, update_buffers, update_delta,
               weighted_average)
from .fedavg import no_robust_sum
from .robust import aggregate_robustly, robust_params


def normalizer(steps: int, momentum: float = 0.0) -> float:
    """||a_i||_1 for `steps` local SGD steps with heavy-ball momentum `momentum`
    (= steps for plain SGD)."""
    if steps < 1:
        raise StrategyError(f"fednova: a local round of {steps} steps has no update to normalise")
    if momentum == 0:
        return float(steps)
    counter = norm = 0.0
    for _ in range(steps):
        counter = momentum * counter + 1.0
        norm += counter
    return norm


def norm_refusal(update: Update, momentum: float) -> str | None:
    """Why `update`'s 'a_norm' scalar is not the ||a_i||_1 its own step count and the round's
    local momentum give (`normalizer`, as the client computes it), or None. The server step
    divides the update by it and scales the sum by tau_eff = sum p_i ||a_i||_1, so a value
    a board's work does not give (0, negative, non-finite, or merely large) would crash the
    round without naming the board, freeze the model or throw it anywhere."""
    if "a_norm" not in update.scalars:
        return "lacks the 'a_norm' scalar"
    got = update.scalars["a_norm"]
    want = normalizer(update.steps, momentum) if update.steps >= 1 else None
    if isinstance(got, bool) or not isinstance(got, (int, float)) or want is None \
            or not math.isclose(got, want, rel_tol=1e-12):
        return (f"has an 'a_norm' scalar its steps do not give: a_norm {got!r}, where "
                f"{update.steps} steps with local momentum {momentum:g} give {want}")
    return None


def checked_norms(name: str, updates, clients, momentum: float) -> list:
    """The 'a_norm' scalars of `clients`' updates, each checked (`norm_refusal`); a
    StrategyError names the clients, so the aggregator refuses them alone."""
    bad = {c: why for c in clients if (why := norm_refusal(updates[c], momentum)) is not None}
    if bad:
        raise StrategyError(f"{name}: update of client(s) {sorted(bad)}: "
                            + "; ".join(f"client {c} {why}" for c, why in bad.items()))
    return [updates[c].scalars["a_norm"] for c in clients]


def nova_coefficients(weights, norms):
    """(c_i for each client, residual weight of the current global model), exact rationals:
    c_i = p_i tau_eff / ||a_i||_1 with tau_eff = sum p_i ||a_i||_1."""
    norms = [Fraction(n) for n in norms]
    tau_eff = sum(p * a for p, a in zip(weights, norms))
    coeffs = [p * tau_eff / a for p, a in zip(weights, norms)]
    return coeffs, 1 - sum(coeffs), tau_eff


@register("fednova")
@dataclass(frozen=True)
class FedNova(Strategy):
    secure_sum = True   # its server step needs only the weighted sum (edgefl.privacy)
    dp_refusal = ("its server step scales by tau_eff, a sum of the clients' local step "
                  "counts that DP's noise does not cover")
    weighting: str = "samples"
    robust: dict | None = extension_field()

    def __post_init__(self):
        check_choice("fednova", "weighting", self.weighting, WEIGHTINGS)
        object.__setattr__(self, "robust", robust_params("fednova", self.robust))

    def aggregate(self, round, updates, state):
        clients, weights = exact_weights(updates, self.weighting)
        momentum = self.local_config(self.setup(state), round, clients[0])["momentum"]
        if self.robust is not None:      # a bad a_norm is rejected as robust rejects the rest
            refusals = {c: f"the update {why}" for c in clients
                        if (why := norm_refusal(updates[c], momentum)) is not None}
            norms = {c: updates[c].scalars.get("a_norm") for c in clients}
            new, accepted, metrics = aggregate_robustly(
                "fednova", round, updates, {"params": state.buffers["params"]}, self.robust,
                self.weighting, normalisers=norms, refusals=refusals)
            metrics["train_loss"] = mean_train_loss(accepted)
            return state.replace(new, round=round), metrics
        norms = checked_norms("fednova", updates, clients, momentum)
        coeffs, residual, tau_eff = nova_coefficients(weights, norms)
        buffers = update_buffers(updates, "params", clients)
        factors = [float(c) for c in coeffs]
        if residual != 0:
            buffers.append(state.buffers["params"])
            factors.append(float(residual))
        params = weighted_average(buffers, factors)
        metrics = {"train_loss": mean_train_loss(updates), "tau_eff": float(tau_eff)}
        return state.replace({"params": params}, round=round), metrics

    def contribution(self, task, update):
        """The weight p_i (n_i or 1) times the normalised delta (w_i - w) / ||a_i||_1, and
        p_i ||a_i||_1 for tau_eff."""
        no_robust_sum(self)
        if not task.upload:
            raise StrategyError(f"contribution: round {task.round}'s task allows no upload")
        why = norm_refusal(update, task.train["momentum"])
        if why is not None:
            raise StrategyError(f"fednova: the update {why}")
        a_norm = update.scalars["a_norm"]
        weight = client_weight(update, self.weighting)
        delta = update_delta(task, update, ("params",))
        normalised = (delta.astype(np.float64) / a_norm).astype(np.float32)
        return Contribution(normalised, weight, {"weighted_a_norm": weight * float(a_norm)})

    def aggregate_sum(self, round, total, state):
        """w + tau_eff * sum_i p_i d_i / sum_i p_i, tau_eff = sum_i p_i ||a_i||_1 / sum_i p_i."""
        no_robust_sum(self)
        mean_delta(total, state.buffers["params"].size)       # checks size and weight
        if "weighted_a_norm" not in total.scalars:       # a sum not of fednova contributions
            raise StrategyError(f"fednova: the sum lacks the 'weighted_a_norm' scalar (it has "
                                f"{sorted(total.scalars)})")
        tau_eff = total.scalars["weighted_a_norm"] / total.weight
        new = apply_mean_delta(state.buffers, ("params",), total, tau_eff)
        return state.replace(new, round=round), {"tau_eff": float(tau_eff)}

    def train(self, task, local_data, client_state):
        params, _, result = local_round(local_data, task.buffers["params"], task.train)
        a_norm = normalizer(result["steps"], task.train["momentum"])
        update = Update({"params": params} if task.upload else {}, local_data.num_samples,
                        result["mean_loss"], result["steps"], {"a_norm": a_norm})
        return update, client_state
