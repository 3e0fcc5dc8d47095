"""FedAvgM, FedAvg with server momentum: Hsu, Qi, Brown, "Measuring the Effects of
Non-Identical Data Distribution for Federated Visual Classification", arXiv 1909.06335, 2019.

Clients train exactly as in FedAvg (the client half is FedAvg's). The server treats the
difference between its model and the clients' average as a gradient and takes a heavy-ball
step with it:

    Delta_t = w_t - sum_{k in S_t} p_k w_{t+1}^k      (p_k: `weighting`, as FedAvg's)
    v_t     = beta v_{t-1} + Delta_t                  (v_0 = 0)
    w_{t+1} = w_t - eta v_t

eta (server learning rate, default 1.0) and beta (momentum, default 0.9, the paper's best
value on its non-IID CIFAR-10 runs) are the parameters. With beta = 0 and eta = 1 the update
is w_{t+1} = sum p_k w_{t+1}^k, FedAvg's.

Implementation: both updates are written as weighted sums of the buffers they depend on,

    v_t     = sum_k (-p_k) w^k + 1 w_t + beta v_{t-1}
    w_{t+1} = sum_k (eta p_k) w^k + (1 - eta) w_t - eta beta v_{t-1}

each computed in one streaming pass with float64 accumulation and one rounding to float32
(kernels.weighted_sum), with coefficients computed exactly (rationals) and rounded once, and
terms whose coefficient is 0 left out. So w_{t+1} is not computed from the rounded v_t, and
with beta = 0, eta = 1 the sum is FedAvg's sum, term for term: FedAvg bit for bit. The server
velocity v is the State buffer "velocity" (float32, checkpointed with the model); only the
model is broadcast.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from . import (WEIGHTINGS, State, Strategy, StrategyError, check_choice, check_number,
               exact_weights, mean_train_loss, register, weighted_average)
from .fedavg import FedAvg


@register("fedavgm")
@dataclass(frozen=True)
class FedAvgM(Strategy):
    secure_sum = True   # its server step needs only the weighted sum (edgefl.privacy)
    eta: float = 1.0
    beta: float = 0.9
    weighting: str = "samples"

    def __post_init__(self):
        check_number("fedavgm", "eta", self.eta, 0.0, math.inf, lo_open=True, hi_open=True,
                     why="the server learning rate")
        check_number("fedavgm", "beta", self.beta, 0.0, 1.0, hi_open=True,
                     why="the server momentum; 1 never forgets an update")
        check_choice("fedavgm", "weighting", self.weighting, WEIGHTINGS)

    def init(self, global_params, cfg):
        state = super().init(global_params, cfg)
        return state.replace({"velocity": np.zeros_like(state.buffers["params"])})

    def aggregate(self, round, updates, state: State):
        clients, weights = exact_weights(updates, self.weighting)
        missing = [c for c in clients if "params" not in updates[c].buffers]
        if missing:
            raise StrategyError(f"fedavgm: update of client(s) {missing} has no 'params' buffer")
        models = [updates[c].buffers["params"] for c in clients]
        w, v = state.buffers["params"], state.buffers["velocity"]
        eta, beta = Fraction(self.eta), Fraction(self.beta)
        velocity = _weighted_sum(models + [w, v], [-p for p in weights] + [1, beta])
        params = _weighted_sum(models + [w, v],
                               [eta * p for p in weights] + [1 - eta, -eta * beta])
        metrics = {"train_loss": mean_train_loss(updates)}
        return state.replace({"params": params, "velocity": velocity}, round=round), metrics

    train = FedAvg.train          # the client half is FedAvg's, unchanged


def _weighted_sum(buffers, coefficients):
    """sum_k c_k buffers[k] with the exact coefficients rounded once to float64 and the
    terms of coefficient 0 left out (so they cannot turn a -0.0 into +0.0, or a sum into
    nan when a left-out buffer holds inf)."""
    terms = [(b, float(c)) for b, c in zip(buffers, coefficients) if c != 0]
    return weighted_average([b for b, _ in terms], [c for _, c in terms])
