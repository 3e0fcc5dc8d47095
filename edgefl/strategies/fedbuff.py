"""FedBuff: Nguyen, Malik, Zhan, Yousefpour, Rabbat, Malek, Huba, "Federated Learning with
Buffered Asynchronous Aggregation", AISTATS 2022, Algorithm 1.

Up to `concurrency` clients train at once, each from the global model of the version current
when it was tasked. The server keeps a buffer; whenever `buffer_size` (K) updates are in it,
it takes one step and the version advances:

    Delta_k = w^k - w_{tau_k}                      (the client's change from its start model)
    w_{v+1} = w_v + eta * sum_k p_k f(s_k) Delta_k,   s_k = v - tau_k (the staleness)

p_k are `weighting`'s weights over the buffer (samples: n_k / sum n; uniform: 1/K, the
paper's), eta the server learning rate, and f the staleness weighting:

    constant     f(s) = 1
    polynomial   f(s) = (1 + s)^-a                           (the paper's choice, a = 0.5)
    hinge        f(s) = 1 for s <= b, else 1 / (a (s - b) + 1)  (Xie et al.'s FedAsync)

An update staler than `max_staleness` is dropped (StrategyError from `aggregate`; the
asynchronous driver refuses it on arrival with `staleness_refusal` and never buffers it).

Who trains when is the caller's: `edgefl/sim/asynchronous.py` keeps `concurrency` clients
busy on the virtual clock and closes the buffer at K through the round engine. Run by the
synchronous engine (a round tasks clients_per_round clients and closes with all of them), every
update is fresh, which is the case K = C with no staleness.

Implementation. The client uploads its model w^k (as FedAvg's client does, the same bytes as a
delta) with the version it started from in its scalars ("version", from the task's). The
server therefore needs w_{tau_k}: it keeps the last `max_staleness` global models as State
buffers "params_v<version>" (checkpointed with the model; max_staleness = 0 keeps none). The
step is one weighted sum over the distinct buffers,

    w_{v+1} = (1 - eta sum_{k: tau_k = v} q_k) w_v + sum_k eta q_k w^k
              - sum_{tau < v} (eta sum_{k: tau_k = tau} q_k) w_tau,      q_k = p_k f(s_k),

with the coefficients computed exactly (rationals of the float parameters), rounded once, and
zero terms left out (`fedavgm._weighted_sum`). With every update fresh, eta = 1 and f = 1,
the coefficient of w_v is exactly 0 and the sum is FedAvg's, term for term: FedAvg bit for
bit (tests/test_fedbuff.py). Client-side momentum (train.momentum) runs as FedAvg's: a fresh
buffer every local round, never uploaded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar
from fractions import Fraction

from . import (WEIGHTINGS, State, Strategy, StrategyError, Task, Update, check_choice,
               check_number, exact_weights, local_round, mean_train_loss, register)
from .fedavgm import _weighted_sum

STALENESS = ("constant", "polynomial", "hinge")
PAST = "params_v"          # State buffer name prefix of the retained past global models


@register("fedbuff")
@dataclass(frozen=True)
class FedBuff(Strategy):
    asynchronous: ClassVar[bool] = True
    secure_sum = False
    secure_sum_refusal = ("each update is weighted by its own staleness and measured from the "
                          "model it started from, so the server step needs the updates one "
                          "by one")
    concurrency: int = 0            # 0: clients_per_round (the driver resolves it)
    buffer_size: int = 0            # 0: concurrency
    eta: float = 1.0
    staleness: str = "polynomial"
    staleness_exponent: float = 0.5
    hinge_a: float = 10.0
    hinge_b: int = 4
    max_staleness: int = 8
    weighting: str = "samples"

    def __post_init__(self):
        for key in ("concurrency", "buffer_size", "hinge_b", "max_staleness"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise StrategyError(f"strategy 'fedbuff': {key} = {value!r} must be an "
                                    f"integer >= 0")
        if self.concurrency and self.buffer_size > self.concurrency:
            raise StrategyError(f"strategy 'fedbuff': buffer_size = {self.buffer_size} is "
                                f"more than concurrency = {self.concurrency} (the buffer "
                                f"could never fill)")
        check_number("fedbuff", "eta", self.eta, 0.0, math.inf, lo_open=True, hi_open=True,
                     why="the server learning rate")
        check_choice("fedbuff", "staleness", self.staleness, STALENESS)
        check_number("fedbuff", "staleness_exponent", self.staleness_exponent, 0.0, math.inf,
                     hi_open=True, why="a of (1 + s)^-a")
        check_number("fedbuff", "hinge_a", self.hinge_a, 0.0, math.inf, hi_open=True,
                     why="the hinge's slope past b")
        check_choice("fedbuff", "weighting", self.weighting, WEIGHTINGS)

    # ---------------------------------------------------------------- asynchronous rules
    def resolved(self, clients_per_round: int) -> tuple:
        """(C, K) of a run selecting `clients_per_round`: 0 means "the run's"."""
        c = self.concurrency or clients_per_round
        k = self.buffer_size or c
        if k > c:
            raise StrategyError(f"strategy 'fedbuff': buffer_size = {k} is more than the "
                                f"concurrency {c} (clients_per_round when concurrency is 0)")
        return c, k

    def weight(self, s: int) -> float:
        """f(s), the staleness weight of an update s versions old."""
        if self.staleness == "constant" or s == 0:
            return 1.0
        if self.staleness == "polynomial":
            return float((1.0 + s) ** -self.staleness_exponent)
        return 1.0 if s <= self.hinge_b else 1.0 / (self.hinge_a * (s - self.hinge_b) + 1.0)

    def staleness_refusal(self, update: Update, state: State) -> str | None:
        """Why `update` cannot go into the buffer of `state`'s next step (too stale, or no
        start version), or None."""
        version = update.scalars.get("version")
        if isinstance(version, bool) or not isinstance(version, int):
            return f"its scalars carry no integer 'version' (got {version!r})"
        current = int(state.meta["round"])
        s = current - version
        if s < 0:
            return f"it started from version {version}, ahead of the server's {current}"
        if s > self.max_staleness:
            return f"staleness {s} > max_staleness {self.max_staleness}"
        return None

    def update_refusal(self, update: Update) -> str | None:
        """Why `update` cannot go into any buffer whatever its staleness (no 'params'
        buffer: the step would fail on it), or None. The asynchronous aggregator refuses
        such an update on arrival, as it refuses a wrong version: once buffered, it would
        fail the step, and the step again after every restart."""
        if "params" not in update.buffers:
            return (f"it carries no 'params' buffer (its buffers: "
                    f"{', '.join(sorted(update.buffers)) or 'none'})")
        return None

    # ---------------------------------------------------------------- server half
    def configure(self, round, clients, state):
        return Task.shared(round, {"params": state.buffers["params"]},
                           self.local_configs(self.setup(state), round, clients),
                           scalars={"version": int(state.meta["round"])})

    def aggregate(self, round, updates, state: State):
        current = int(state.meta["round"])
        keys, p = exact_weights(updates, self.weighting)
        coeffs: dict = {}                     # buffer key -> exact coefficient
        buffers: dict = {}
        stale = []
        for key, p_k in zip(keys, p):
            u = updates[key]
            why = self.staleness_refusal(u, state)
            if why is not None:
                raise StrategyError(f"fedbuff: round {round}: update of client {key}: {why}")
            why = self.update_refusal(u)
            if why is not None:
                raise StrategyError(f"fedbuff: round {round}: update of client {key}: {why}")
            s = current - u.scalars["version"]
            stale.append(s)
            q = Fraction(self.eta) * p_k * Fraction(self.weight(s))
            buffers[("client", key)] = u.buffers["params"]
            coeffs[("client", key)] = q
            start = "params" if s == 0 else f"{PAST}{u.scalars['version']}"
            buffers[start] = state.buffers[start]
            coeffs[start] = coeffs.get(start, 0) - q
        coeffs["params"] = coeffs.get("params", 0) + 1
        buffers.setdefault("params", state.buffers["params"])
        # clients in sorted order first, then the model and the past models: with every
        # update fresh this is FedAvg's sum exactly (the model's coefficient is 0)
        order = [("client", k) for k in keys] + ["params"] + \
            sorted((b for b in buffers if isinstance(b, str) and b != "params"),
                   key=lambda b: int(b[len(PAST):]))
        params = _weighted_sum([buffers[b] for b in order], [coeffs[b] for b in order])
        new = {"params": params}
        if self.max_staleness > 0:
            new[f"{PAST}{current}"] = state.buffers["params"]
        kept = {name: buf for name, buf in state.buffers.items()
                if not name.startswith(PAST)
                or int(name[len(PAST):]) > current - self.max_staleness}
        kept.update(new)
        metrics = {"train_loss": mean_train_loss(updates),
                   "staleness_mean": sum(stale) / len(stale), "staleness_max": max(stale)}
        return State(kept, {**state.meta, "round": round}), metrics

    # ---------------------------------------------------------------- client half
    def train(self, task, local_data, client_state):
        params, _, result = local_round(local_data, task.buffers["params"], task.train)
        version = task.scalars.get("version")
        if version is None:
            raise StrategyError("fedbuff: the task carries no 'version' scalar")
        update = Update({"params": params} if task.upload else {}, local_data.num_samples,
                        result["mean_loss"], result["steps"], {"version": int(version)})
        return update, client_state
