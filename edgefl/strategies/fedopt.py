"""FedAdam and FedYogi: Reddi, Charles, Zaheer, Garrett, Rush, Konecny, Kumar, McMahan,
"Adaptive Federated Optimization", ICLR 2021, Algorithm 2 (FedOpt with an adaptive server
optimiser).

Clients train exactly as in FedAvg (the client half is FedAvg's) and upload their models
x_i. The server treats the average client update as a pseudo-gradient and takes one step of
an adaptive optimiser with it, per coordinate:

    Delta_t = sum_{i in S_t} p_i (x_i - x_t)                 (p_i: `weighting`)
    m_t     = beta1 m_{t-1} + (1 - beta1) Delta_t
    v_t     = beta2 v_{t-1} + (1 - beta2) Delta_t^2                             (FedAdam)
    v_t     = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)         (FedYogi)
    x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)

with m_{-1} = 0 and v_{-1} = tau^2 (the paper initialises v at tau^2 or above), and, as in
Algorithm 2, no bias correction. Parameters as in the paper: eta (server learning rate),
beta1 (0.9), beta2 (0.99), tau (adaptivity, 1e-3). The default eta is chosen on digits
(edgefl/configs/fedadam.yaml and fedyogi.yaml say how); the paper tunes it per task.
Yogi's v changes by at most (1 - beta2) Delta^2 in either direction, towards Delta^2, so a
burst of large updates inflates it less than Adam's.

Deviation: Algorithm 2 averages the updates of the sampled clients uniformly; `weighting`
(default uniform, the paper's) may be set to samples, p_i = |D_i| / sum |D_j|, FedAvg's
weights.

Numerics: Delta_t is one streaming weighted sum over the uploads and x_t with float64
accumulation (kernels.weighted_sum: sum_i p_i x_i - x_t, rounded once to float32); the
optimiser step runs in float64 and its results are rounded to float32 once. The server
state m and v are the State buffers "m" and "v" (float32), checkpointed with the model, so
a resumed run continues the same optimiser; only the model is broadcast.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import (WEIGHTINGS, State, Strategy, StrategyError, aggregation_weights, check_choice,
               check_number, mean_train_loss, register, weighted_average)
from .fedavg import FedAvg


@dataclass(frozen=True)
class _FedOpt(Strategy):
    """FedOpt with an adaptive server optimiser; subclasses say how v is updated."""
    secure_sum = True   # its server step needs only the weighted sum (edgefl.privacy)
    eta: float = 0.03
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    weighting: str = "uniform"

    def __post_init__(self):
        name = self.name
        check_number(name, "eta", self.eta, 0.0, math.inf, lo_open=True, hi_open=True,
                     why="the server learning rate")
        check_number(name, "beta1", self.beta1, 0.0, 1.0, hi_open=True,
                     why="the decay of the first moment m")
        check_number(name, "beta2", self.beta2, 0.0, 1.0, hi_open=True,
                     why="the decay of the second moment v")
        check_number(name, "tau", self.tau, 0.0, math.inf, lo_open=True, hi_open=True,
                     why="the adaptivity; v starts at tau^2 and sqrt(v) + tau divides")
        check_choice(name, "weighting", self.weighting, WEIGHTINGS)

    def init(self, global_params, cfg):
        state = super().init(global_params, cfg)
        x = state.buffers["params"]
        return state.replace({"m": np.zeros_like(x),
                              "v": np.full_like(x, np.float32(self.tau) ** 2)})

    def aggregate(self, round, updates, state: State):
        clients, weights = aggregation_weights(updates, self.weighting)
        missing = [c for c in clients if "params" not in updates[c].buffers]
        if missing:
            raise StrategyError(f"{self.name}: update of client(s) {missing} has no 'params' "
                                f"buffer")
        x = state.buffers["params"]
        # Delta_t = sum p_i x_i - x_t: the weights sum to 1, so this is sum p_i (x_i - x_t)
        delta = weighted_average([updates[c].buffers["params"] for c in clients] + [x],
                                 list(weights) + [-1.0]).astype(np.float64)
        m = self.beta1 * state.buffers["m"].astype(np.float64) + (1 - self.beta1) * delta
        v = self.second_moment(state.buffers["v"].astype(np.float64), delta * delta)
        step = self.eta * m / (np.sqrt(v) + self.tau)
        params = (x.astype(np.float64) + step).astype(np.float32)
        metrics = {"train_loss": mean_train_loss(updates),
                   "server_step_norm": float(np.linalg.norm(step))}
        return state.replace({"params": params, "m": m.astype(np.float32),
                              "v": v.astype(np.float32)}, round=round), metrics

    def second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    train = FedAvg.train          # the client half is FedAvg's, unchanged


@register("fedadam")
@dataclass(frozen=True)
class FedAdam(_FedOpt):
    def second_moment(self, v, delta_sq):
        return self.beta2 * v + (1 - self.beta2) * delta_sq


@register("fedyogi")
@dataclass(frozen=True)
class FedYogi(_FedOpt):
    def second_moment(self, v, delta_sq):
        return v - (1 - self.beta2) * delta_sq * np.sign(v - delta_sq)
