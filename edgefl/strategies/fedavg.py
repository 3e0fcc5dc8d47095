"""FedAvg: McMahan, Moore, Ramage, Hampson, Agüera y Arcas, "Communication-Efficient Learning
of Deep Networks from Decentralized Data", AISTATS 2017, Algorithm 1.

Each selected client k starts from the broadcast global model w_t, runs E local epochs (or
tau steps) of minibatch SGD on its data, and uploads w_{t+1}^k. The server sets

    w_{t+1} = sum_{k in S_t} p_k w_{t+1}^k,    p_k = n_k / sum_{j in S_t} n_j   (weighting: samples)
                                               p_k = 1 / |S_t|                  (weighting: uniform)

The weights are renormalised over the clients that uploaded. Local momentum (train.momentum
> 0) uses a fresh zero buffer every round; nothing but the model crosses the network. The
client keeps no state.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import (WEIGHTINGS, Strategy, Update, aggregation_weights, average_updates, check_choice,
               local_round, mean_train_loss, register)


@register("fedavg")
@dataclass(frozen=True)
class FedAvg(Strategy):
    weighting: str = "samples"

    def __post_init__(self):
        check_choice("fedavg", "weighting", self.weighting, WEIGHTINGS)

    def aggregate(self, round, updates, state):
        clients, weights = aggregation_weights(updates, self.weighting)
        params = average_updates(updates, "params", clients, weights)
        metrics = {"train_loss": mean_train_loss(updates)}
        return state.replace({"params": params}, round=round), metrics

    def train(self, task, local_data, client_state):
        params, _, result = local_round(local_data, task.buffers["params"], task.train)
        update = Update({"params": params} if task.upload else {}, local_data.num_samples,
                        result["mean_loss"], result["steps"])
        return update, client_state
