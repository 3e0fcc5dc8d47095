"""FedProx: Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in
Heterogeneous Networks", MLSys 2020, Algorithm 2.

Each selected client k starts from the broadcast global model w^t and, instead of F_k alone,
minimises the proximal objective

    h_k(w; w^t) = F_k(w) + (mu/2) ||w - w^t||^2

with FedAvg's local minibatch SGD (E epochs or tau steps): every step follows the gradient of
h_k, grad F_k(w) + mu (w - w^t). The term pulls each local model back towards the round's
start, which limits how far clients with different data drift apart. The server half is
FedAvg's: w^{t+1} = sum_k p_k w_k^{t+1}, p_k = n_k / sum_j n_j (`weighting: samples`) or
1 / |S_t| (`weighting: uniform`), renormalised over the clients that uploaded.

- mu (default 0.01; the paper tunes it over {0.001, 0.01, 0.1, 1}) must be finite and >= 0.
  mu = 0 is FedAvg bit for bit: the kernel skips the term, the tasks carry the same train
  values, and aggregation is FedAvg's code.
- The term is added after weight decay and before momentum (train.momentum > 0 keeps
  FedAvg's fresh-every-round local momentum; the paper uses plain SGD). Its centre is the
  task's global buffer itself, read in place: the client copies nothing extra and uploads
  only the model, as in FedAvg.
- Deviation: Algorithm 2 lets each device return a gamma-inexact solution, and the paper's
  experiments make some selected devices stragglers that run fewer local epochs and are
  still aggregated (FedAvg drops them). Here every selected client runs the configured local
  work, so this is FedProx's answer to statistical heterogeneity (the proximal term); the
  systems-heterogeneity experiment, variable local work, is not simulated.
- Deviation, as in the authors' published code rather than Algorithm 2's text: clients are
  selected uniformly (the shared `select_clients`) and averaged with sample-count weights,
  where Algorithm 2 samples devices with probability p_k and averages them uniformly.
- `robust` (strategies/robust.py, an extension): the server aggregates the updates with a
  robust rule as FedAvg does; unset, the average above.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import (WEIGHTINGS, StrategyError, Task, check_choice, check_number, mean_train_loss,
               register)
from .fedavg import FedAvg
from .robust import aggregate_robustly, robust_params


@register("fedprox")
@dataclass(frozen=True)
class FedProx(FedAvg):
    mu: float = 0.01

    def __post_init__(self):
        check_number("fedprox", "mu", self.mu, 0.0, math.inf, hi_open=True,
                     why="the proximal coefficient; 0 is FedAvg")
        check_choice("fedprox", "weighting", self.weighting, WEIGHTINGS)
        object.__setattr__(self, "robust", robust_params("fedprox", self.robust))

    def init(self, global_params, cfg):
        if cfg.train.get("prox_mu", 0.0):
            raise StrategyError(f"fedprox: train.prox_mu = {cfg.train['prox_mu']} conflicts "
                                f"with the strategy's mu; set strategy mu and leave "
                                f"train.prox_mu unset")
        return super().init(global_params, cfg)

    def configure(self, round, clients, state):
        return Task.shared(round, {"params": state.buffers["params"]},
                           self.local_configs(self.setup(state), round, clients,
                                              prox_mu=self.mu))

    def aggregate(self, round, updates, state):
        if self.robust is None:
            return super().aggregate(round, updates, state)
        # FedAvg's robust branch, with this strategy's name in what it reports
        base = {"params": state.buffers["params"]}
        new, accepted, metrics = aggregate_robustly("fedprox", round, updates, base,
                                                    self.robust, self.weighting)
        metrics["train_loss"] = mean_train_loss(accepted)
        return state.replace(new, round=round), metrics

    # train: FedAvg's. `local_round` hands the task's global buffer to the kernel as the
    # proximal term's centre, and the task's train config carries prox_mu = mu.
