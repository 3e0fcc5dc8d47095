"""DR-FedAvg: Zhao, Joshi, "A dynamic reweighting strategy for fair federated learning",
ICASSP 2022, as the DUW paper (Nakai-Kasai, Wadayama, arXiv 2212.12191, eq. (12)) states and
runs it as a baseline. Every round the server weights client k by its share of the data
times a power of its loss at the broadcast model,

    Theta_k^(t) = (N_k/N) l_k(w^(t))^(q+1) / sum_l (N_l/N) l_l(w^(t))^(q+1),   q >= 0

    w^(t+1) = sum_k Theta_k^(t) w_k^(t),

so a client the global model serves badly pulls harder (fairness); q = 0 weights by the data
share times the loss, and with equal losses the weights are FedAvg's N_k / N.

It runs in DUW's environment, which is why it is a DUW with its table replaced by (12)
computed each round, not a FedAvg option: every client every round, per-client local epochs
E_k (`local_epochs`), per-client upload probabilities p_k (`upload_prob`) drawn from DUW's
own stream, and a client whose upload failed contributing the broadcast model w^(t) with
its full weight (the DUW paper's deployment rule for all its weighted baselines). So in one
environment DR-FedAvg, FedAvg (DUW with M = 0) and DUW-FedAvg differ only in the weights.

l_k(w^(t)) is the mean loss of the broadcast model over client k's whole local data set,
as (12) writes it: the client evaluates it before its local round and sends it with its
update (`Update.scalars["start_loss"]`). (The DUW authors' code uses instead the sum of
the minibatch losses of the local round, which grows with E_k n_k; we follow the text.)
Non-paper: a client whose upload failed sent no loss, so its weight uses the mean loss of
the clients that did report this round (its weight is then about its data share); if none
reported, the weights are N_k / N.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from .. import kernels
from . import (StrategyError, Update, check_choice, check_number, local_round, number_scalars,
               register)
from .duw import DUW
from .duw.unrolled import sorted_clients

START_LOSS = "start_loss"


def dr_weights(num_samples, losses, q: float) -> np.ndarray:
    """The weights (12): (N_k/N) l_k^(q+1), normalised to sum to 1 (float64). A loss must be
    finite and >= 0; if every term is 0 (all losses 0), the data shares N_k / N.

    (12) is a ratio: where a power l_k^(q+1) overflows float64 (1e200^2) or underflows
    (1e-200^2), which made the weights NaN or silently the data shares, the losses are
    divided by the largest first, and if the scaled terms still underflow (the largest loss
    on a client without data) the ratio is taken in log space. Otherwise the terms are
    computed as written."""
    n = np.asarray(num_samples, dtype=np.float64)
    loss = np.asarray(losses, dtype=np.float64)
    if n.shape != loss.shape or n.ndim != 1 or not n.size:
        raise StrategyError(f"strategy 'drfedavg': {n.size} sample counts for {loss.size} losses")
    if not np.all(np.isfinite(loss)) or np.any(loss < 0):
        raise StrategyError(f"strategy 'drfedavg': losses {loss.tolist()} must be finite and >= 0 "
                            f"(a diverged local model cannot be weighted by its loss)")
    if not np.all(n >= 0) or not n.sum() > 0:
        raise StrategyError(f"strategy 'drfedavg': sample counts {n.tolist()} cannot weight "
                            f"an average")
    share = n / n.sum()
    live = (share > 0) & (loss > 0)          # the terms that are not 0 in exact arithmetic
    if not live.any():
        return share
    with np.errstate(over="ignore", under="ignore"):
        terms = share * loss ** (q + 1.0)
        total = terms.sum()
    if np.isfinite(total) and np.all(terms[live] >= np.finfo(np.float64).tiny):
        return terms / total
    scaled = np.where(live, loss / loss[live].max(), 0.0)     # the live ones in (0, 1]
    with np.errstate(under="ignore"):
        terms = share * scaled ** (q + 1.0)
    if not np.all(terms[live] >= np.finfo(np.float64).tiny):
        with np.errstate(divide="ignore"):
            logs = np.where(live, np.log(share) + (q + 1.0) * np.log(scaled), -np.inf)
        terms = np.exp(logs - logs.max())
    return terms / terms.sum()


@register("drfedavg")
@dataclass(frozen=True)
class DRFedAvg(DUW):
    """DR-FedAvg in DUW's environment.

    q:            the exponent's hyperparameter, >= 0 (the DUW paper uses q = 1).
    local_epochs, upload_prob: the environment, as for DUW.
    DUW's table-learning parameters (meta_iterations, meta_lr, meta_init_seed,
    beyond_horizon) are accepted so one environment section serves every arm, and unused;
    a table or weight file is refused, and base must be fedavg."""
    secure_sum_refusal = "it weights each update by the loss its client reported"
    q: float = 1.0

    def __post_init__(self):
        check_choice("drfedavg", "base", self.base, ("fedavg",))
        if self.weights is not None or self.table is not None:
            raise StrategyError("strategy 'drfedavg': its weights come from the clients' losses "
                                "every round; weights = / table = are DUW's and do not apply")
        check_number("drfedavg", "q", self.q, 0, math.inf, hi_open=True,
                     why="(12) raises the loss to q + 1 with q >= 0")
        super().__post_init__()

    def prepare(self, init_params, clients, setup, context=None):
        """No offline phase: the environment lists are checked against the federation (and
        clients_per_round, which must be every client), and the clients' N_k kept, which
        weigh a client whose upload failed."""
        self.check_environment(setup, context)
        sizes = [d.num_samples for d in sorted_clients(clients, setup)]
        return dataclasses.replace(self, num_samples=tuple(int(n) for n in sizes))

    def init(self, global_params, cfg):
        # DUW's init checks its table, which DR-FedAvg has not; the environment is checked
        self.epochs_of(cfg)
        self.upload_probs(cfg)
        return super(DUW, self).init(global_params, cfg)

    def aggregate(self, round, updates, state):
        """(12) then (19) over every client in sorted id order; a client without an update
        contributes w^(t) (see the module docstring for its loss)."""
        setup = self.federation_of(updates, state)
        # the loss of w^(t) on each client's data, eq. (12)
        reported = number_scalars("strategy 'drfedavg'", updates, START_LOSS, sorted(updates))
        fill = float(np.mean(list(reported.values()))) if reported else 1.0
        losses = [reported.get(c, fill) for c in setup.clients]
        sizes = self._sizes(setup.clients, updates)
        theta = dr_weights(sizes, losses, self.q)
        return self.weighted_step(round, updates, state, setup, theta, start_loss=losses)

    def _sizes(self, clients, updates) -> list:
        """N_k of every client: from its update, else from `prepare` (num_samples), else
        (a strategy that skipped prepare) the mean of the reported counts."""
        if self.num_samples is not None:
            return list(self.num_samples)
        reported = [updates[c].num_samples for c in sorted(updates)] or [1]
        return [updates[c].num_samples if c in updates else float(np.mean(reported))
                for c in clients]

    def train(self, task, local_data, client_state):
        if not task.upload:     # the upload will not get through: nothing to compute
            return Update({}, local_data.num_samples, float("nan"), 0), client_state
        start = kernels.evaluate_samples(local_data.samples, task.buffers["params"])["loss"]
        params, _, result = local_round(local_data, task.buffers["params"], task.train)
        return (Update({"params": params}, local_data.num_samples, result["mean_loss"],
                       result["steps"], {START_LOSS: float(start)}), client_state)
