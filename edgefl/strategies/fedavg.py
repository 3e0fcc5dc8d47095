"""FedAvg: McMahan, Moore, Ramage, Hampson, Agüera y Arcas, "Communication-Efficient Learning
of Deep Networks from Decentralized Data", AISTATS 2017, Algorithm 1.

Each selected client k starts from the broadcast global model w_t, runs E local epochs (or
tau steps) of minibatch SGD on its data, and uploads w_{t+1}^k. The server sets

    w_{t+1} = sum_{k in S_t} p_k w_{t+1}^k,    p_k = n_k / sum_{j in S_t} n_j   (weighting: samples)
                                               p_k = 1 / |S_t|                  (weighting: uniform)

The weights are renormalised over the clients that uploaded. Local momentum (train.momentum
> 0) uses a fresh zero buffer every round; nothing but the model crosses the network. The
client keeps no state.

`robust` (strategies/robust.py) aggregates the updates w_{t+1}^k - w_t instead, with a
median, trimmed mean or clipped mean, after rejecting non-finite and outsized ones; unset,
the average above is computed exactly as written.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import (WEIGHTINGS, Strategy, Update, aggregation_weights, average_updates, check_choice,
               extension_field, local_round, mean_train_loss, register)
from .robust import aggregate_robustly, robust_params


@register("fedavg")
@dataclass(frozen=True)
class FedAvg(Strategy):
    secure_sum = True   # its server step needs only the weighted sum (edgefl.privacy)
    weighting: str = "samples"
    robust: dict | None = extension_field()

    def __post_init__(self):
        check_choice("fedavg", "weighting", self.weighting, WEIGHTINGS)
        object.__setattr__(self, "robust", robust_params("fedavg", self.robust))

    def aggregate(self, round, updates, state):
        if self.robust is not None:
            base = {"params": state.buffers["params"]}
            new, accepted, metrics = aggregate_robustly("fedavg", round, updates, base,
                                                        self.robust, self.weighting)
            metrics["train_loss"] = mean_train_loss(accepted)
            return state.replace(new, round=round), metrics
        clients, weights = aggregation_weights(updates, self.weighting)
        params = average_updates(updates, "params", clients, weights)
        metrics = {"train_loss": mean_train_loss(updates)}
        return state.replace({"params": params}, round=round), metrics

    def train(self, task, local_data, client_state):
        params, _, result = local_round(local_data, task.buffers["params"], task.train)
        update = Update({"params": params} if task.upload else {}, local_data.num_samples,
                        result["mean_loss"], result["steps"])
        return update, client_state
