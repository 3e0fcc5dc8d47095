"""FedUmf, Federated Learning with Unauthorized Model Fusion: Li, Chen, Yu, "Model Fusion from
Unauthorized Clients in Federated Learning", Mathematics 10(20):3751,
2022; docs/algorithms.md#fedumf.

Every round the server authorises M clients S_t to upload (uplink cost as FedAvg's), but
broadcasts theta_t to ALL N clients and every client trains (the paper's §3.2 and
Algorithm 1; the numbers below are the step numbers the code comments use):

 3. theta_{t,0}^i <- theta_t
 4. fusion, only if i in S_t and i not in S_{t-1} (authorised now, unauthorised last round):
        theta_{t,0}^i <- theta_{t,0}^i + alpha (eta_t / eta_{t-1}) g_{t-1}^i          (F)
 5. K local SGD steps from theta_{t,0}^i (fresh momentum buffer, see below)
 6. store g_t^i <- theta_{t+1}^i - theta_{t,0}^i, measured from the fused start (§3.2)
 7. upload theta_{t+1}^i only if i in S_t (it includes the fused term); others send nothing
 8. theta_{t+1} <- (1/M) sum_{i in S_t} theta_{t+1}^i

Where the paper leaves a point open, edgefl's choices (docs/algorithms.md#fedumf):
- K is a `train` setting: local epochs (the paper's "K=1", §5.1.2) or steps.
- alpha = 1 by default (the paper's range is (0, 1]); alpha = 0 turns fusion off (exactly
  FedAvg, which tests/test_strategies.py checks bit for bit).
- the local momentum buffer (the paper's "Mo = 0.5", §5.1.2) is fresh every round; it is not
  fused or transmitted: the paper fuses only the stored update g.
- equal weights 1/M by default (the paper's average); `weighting: samples` is the m_i option.
- S_t is M clients uniformly without replacement (`select_clients`, outside).
- eta_0 := eta_1; the term multiplies g_0 = 0 anyway (no fusion in round 1).
- missed broadcast: g is stored with its round r; it is fused only if r = t-1 and the
  client was unauthorised in r, otherwise it counts as 0 (policy "skip stale").
- several unauthorised rounds: only the latest g (round t-1) is kept: staleness <= 1.
- last round: unauthorised training in round T can never be used and is skipped
  (identical results); with Setup.rounds = 0 (open-ended) every round trains everyone.
- LR ratio: eta_{t-1} is the lr the client actually used for g, stored with it.

The server keeps no per-client state: its State is theta only. A client's State is
g plus (round, authorised, lr). The round metric "fused" lists the clients whose start point
took a stored update this round (F_t = S_t minus S_{t-1}, from round 2 on); with
alpha = 0 the rule still fires but adds nothing, so the fused set does not depend on alpha.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import kernels
from . import (WEIGHTINGS, State, Strategy, StrategyError, Task, Update, aggregation_weights,
               average_updates, check_choice, check_number, local_round, mean_train_loss, register)


@register("fedumf")
@dataclass(frozen=True)
class FedUmf(Strategy):
    secure_sum = True   # its server step needs only the weighted sum (edgefl.privacy)
    alpha: float = 1.0
    weighting: str = "uniform"

    def __post_init__(self):
        check_number("fedumf", "alpha", self.alpha, 0.0, 1.0,
                     why="the fusion coefficient, in (0, 1] in the paper's §3.2; 0 turns "
                         "fusion off")
        check_choice("fedumf", "weighting", self.weighting, WEIGHTINGS)

    def configure(self, round, clients, state):
        """Tasks for every client of the federation (the paper broadcasts theta_t to all):
        the selected ones may upload, the rest train and keep their update. In the last planned
        round only the selected ones train (the others' work could never be used)."""
        setup = self.setup(state)
        authorised = {int(c) for c in clients}
        unknown = sorted(authorised - set(setup.clients))
        if unknown:
            raise StrategyError(f"fedumf: selected client(s) {unknown} are not in the federation")
        last = setup.rounds > 0 and round >= setup.rounds
        shared = {"params": state.buffers["params"]}
        return {c: Task(round, shared, self.local_config(setup, round, c), upload=c in authorised)
                for c in setup.clients if c in authorised or not last}

    def aggregate(self, round, updates, state):
        clients, weights = aggregation_weights(updates, self.weighting)
        params = average_updates(updates, "params", clients, weights)      # step 8
        metrics = {"train_loss": mean_train_loss(updates),
                   "fused": [c for c in clients if updates[c].scalars.get("fused")]}
        return state.replace({"params": params}, round=round), metrics

    def train(self, task, local_data, client_state):
        start = np.array(task.buffers["params"], copy=True)                 # step 3
        fused = self.fuses(task, client_state)
        if fused:                                                           # step 4, (F)
            coeff = self.alpha * task.train["lr"] / client_state.meta["lr"]
            if coeff != 0:
                kernels.axpy(start, client_state.buffers["g"], coeff)
        params, _, result = local_round(local_data, start, task.train)     # step 5
        g = np.subtract(params, start)                                      # step 6
        new_state = State({"g": g}, {"round": task.round, "authorized": bool(task.upload),
                                     "lr": float(task.train["lr"])})
        update = Update({"params": params} if task.upload else {},          # step 7
                        local_data.num_samples, result["mean_loss"], result["steps"],
                        {"fused": fused})
        return update, new_state

    @staticmethod
    def fuses(task: Task, client_state: State | None) -> bool:
        """Rule (F)'s condition: authorised now, unauthorised in round t-1, and holding the
        update g_{t-1} it computed then (a missed round means nothing to fuse)."""
        return bool(task.upload and client_state is not None
                    and client_state.meta.get("round") == task.round - 1
                    and not client_state.meta.get("authorized", True))
