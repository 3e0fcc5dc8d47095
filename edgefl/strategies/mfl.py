"""MFL, Momentum Federated Learning: Liu, Chen, Chen, Zhang, "Accelerating Federated
Learning via Momentum Gradient Descent", IEEE TPDS 31(8), 2020 (docs/algorithms.md#mfl).

Client i runs tau local heavy-ball (MGD) steps from the broadcast (w, d), the paper's §4.2:

    d_i(t) = gamma d_i(t-1) + grad F_i(w_i(t-1))        (6)
    w_i(t) = w_i(t-1) - eta d_i(t)                      (7)

d accumulates raw gradients and eta multiplies the whole buffer (PyTorch SGD, dampening 0),
which is the kernels' convention; with an lr schedule the current eta is applied to d and d
is never rescaled (a choice of ours: the paper keeps eta constant). Every round the client
uploads BOTH w_i and d_i; the server averages both with the same weights p_i = |D_i| / |D|
and broadcasts both (§4.2):

    d(k tau) = sum_i p_i d_i(k tau)                     (8)
    w(k tau) = sum_i p_i w_i(k tau)                     (9)

Neither is reset: momentum carries across rounds through its average, d(0) = 0 (§7.1).
The server keeps no state of its own beyond (w, d); clients keep none (they overwrite both
buffers with the broadcast).

- gamma = 0 is FedAvg bit for bit (tests/test_strategies.py checks it): the kernel's buffer
  update d = 0*d + g then w -= eta*d is exactly plain SGD, and the parameter average uses the
  same weights in the same order.
- gamma must be in [0, 1) (the paper's §3.1.2: MGD converges for -1 < gamma < 1 and
  accelerates for 0 < gamma < 1; gamma >= 1 is rejected by validation).
- MFL is specified for synchronous full participation (all N nodes upload, §4.2). With
  fewer uploads than clients the weights are renormalised over the uploaders: an extension,
  labelled as such in the round metrics ("partial_participation": true).
- The momentum is MFL's; `train.momentum` must stay 0 (set `gamma`).
- Traffic is 2x FedAvg's in both directions (the paper's §7.2.5): two buffers each way.
- `robust` (strategies/robust.py, an extension): (8) and (9) become the same robust rule
  applied to the momentum and model updates d_i - d, w_i - w; a client rejected for either
  buffer is dropped from both, and clipping scales both by its model update's factor.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import (WEIGHTINGS, Strategy, StrategyError, Task, Update, aggregation_weights,
               apply_mean_delta, average_updates, check_choice, check_number, contribution_of,
               extension_field, local_round, mean_train_loss, register)
from .fedavg import no_robust_sum
from .robust import aggregate_robustly, robust_params


@register("mfl")
@dataclass(frozen=True)
class MFL(Strategy):
    secure_sum = True   # its server step needs only the weighted sum (edgefl.privacy)
    gamma: float = 0.5
    weighting: str = "samples"
    robust: dict | None = extension_field()

    def __post_init__(self):
        check_number("mfl", "gamma", self.gamma, 0.0, 1.0, hi_open=True,
                     why="the momentum attenuation factor; the paper's §3.1.2 needs gamma < 1")
        check_choice("mfl", "weighting", self.weighting, WEIGHTINGS)
        object.__setattr__(self, "robust", robust_params("mfl", self.robust))

    def init(self, global_params, cfg):
        if cfg.train.get("momentum", 0.0):
            raise StrategyError(f"mfl: train.momentum = {cfg.train['momentum']} conflicts with "
                                f"MFL's own momentum; set strategy gamma instead and leave "
                                f"train.momentum at 0")
        state = super().init(global_params, cfg)
        return state.replace({"momentum": np.zeros_like(state.buffers["params"])})

    def configure(self, round, clients, state):
        shared = {"params": state.buffers["params"], "momentum": state.buffers["momentum"]}
        return Task.shared(round, shared, self.local_configs(self.setup(state), round, clients,
                                                             momentum=self.gamma))

    def aggregate(self, round, updates, state):
        if self.robust is not None:
            base = {"params": state.buffers["params"], "momentum": state.buffers["momentum"]}
            new, accepted, metrics = aggregate_robustly("mfl", round, updates, base,
                                                        self.robust, self.weighting)
            metrics["train_loss"] = mean_train_loss(accepted)
            if len(accepted) < len(self.setup(state).clients):
                metrics["partial_participation"] = True
            return state.replace(new, round=round), metrics
        clients, weights = aggregation_weights(updates, self.weighting)
        params = average_updates(updates, "params", clients, weights)       # (9)
        momentum = average_updates(updates, "momentum", clients, weights)   # (8)
        metrics = {"train_loss": mean_train_loss(updates)}
        if len(clients) < len(self.setup(state).clients):
            metrics["partial_participation"] = True
        return state.replace({"params": params, "momentum": momentum}, round=round), metrics

    def contribution(self, task, update):
        """n_i (or 1) times the deltas of w and of d, end to end."""
        no_robust_sum(self)
        return contribution_of(task, update, ("params", "momentum"), self.weighting)

    def aggregate_sum(self, round, total, state):
        """(8) and (9) from the sum: each buffer plus its weighted mean delta."""
        no_robust_sum(self)
        new = apply_mean_delta(state.buffers, ("params", "momentum"), total)
        metrics = {}
        if total.count < len(self.setup(state).clients):
            metrics["partial_participation"] = True
        return state.replace(new, round=round), metrics

    def train(self, task, local_data, client_state):
        params, momentum, result = local_round(local_data, task.buffers["params"], task.train,
                                               momentum=task.buffers["momentum"])
        buffers = {"params": params, "momentum": momentum} if task.upload else {}
        update = Update(buffers, local_data.num_samples, result["mean_loss"], result["steps"])
        return update, client_state
