"""FedVeca, Federated Vectorized Averaging: Luo, Cheng, Xiong, Liu, Wu, "FedVeca: Federated
Vectorized Averaging on Non-IID Data with Adaptive Bi-directional Global Objective"
(preprint 2021/22; docs/algorithms.md#fedveca). Section, equation, algorithm and line
numbers below are the paper's. Paper round k = 0..K-1 is our round t = k + 1.

FedNova's normalised aggregation with a per-client, per-round number of local SGD steps
tau_(k,i) (the "step size" of the "bi-directional vector" G_(k,i); not the learning rate).

Client i, round k (§II-A, Algorithm 2): tau_(k,i) plain SGD steps from w_k, fresh minibatch
each step (1);
it uploads w^tau_(k,i), its gradient at w_k, and from k >= 1 the estimates beta and delta,
computed in O(d) memory from the kernel's per-step statistics (`kernels.local_train`
step_stats: ||grad0 - g^s||, ||w_k - w^s||, ||sum_{r<=s} g^r||^2, before step s's update):

    beta_(k,i)  = max_{s in [1, tau-1]} ||grad F_i(w_k) - g^s|| / ||w_k - w^s||  (Alg. 2 l.15-16)
    delta_(k,i) = max_{s in [1, tau-1]} ||sum_{r<=s} g^r||^2 / ((s+1) ||grad F(w_{k-1})||^2)
                                        (Alg. 2 l.17, `delta_variant: alg2`, the default)
                  max_{s in [1, tau-1]} ||w_k - w^s||^2 / (eta^2 s ||grad F(w_{k-1})||^2)
                                        (A4 / eq. (23), `delta_variant: theory`)

Alg. 2 l.15 includes s = 0, which is 0/0 (w^0 = w_k), so s starts at 1; Alg. 2 l.17 and
Assumption 4 / eq. (23) index the sum differently, hence the two delta variants.
grad F_i(w_k) is g^0, the first minibatch gradient (`grad_at_global: batch`, our default: the
paper's §III-B1 computes every gradient on minibatches), or the full local gradient
(`grad_at_global: full`, §III-B2's "on the local training dataset"; one extra pass).

Server, round k (§III-B, Algorithm 1):

 1. grad F(w_k) = sum_i p_i grad F_i(w_k)                                               (8)
 2. tau_k = sum_i p_i tau_(k,i), d_k = sum_i p_i G_(k,i), w_{k+1} = w_k - eta tau_k d_k   (5)
    with G_(k,i) = (w_k - w^tau_(k,i)) / (eta tau_(k,i)). Computed as FedNova's single
    weighted sum of the uploaded models (`fednova.nova_coefficients`, tau_i the steps the
    client actually ran, not the tau_{k+1} that Alg. 1 l.18 computes before its reset to
    2 at l.19-21), so fixed tau_i reproduce FedNova bit for bit and equal tau_i reproduce
    FedAvg bit for bit (tests/test_fedveca.py checks both).
 3. k >= 1: L_{k-1} = ||grad F(w_{k-1}) - grad F(w_{k-2})|| / ||w_{k-1} - w_{k-2}||
    (L_0 = ||grad F(w_0)|| / ||w_0||, Alg. 1 l.12, skipped when ||w_0|| < 1e-12: it is
    infinite for a zero initial model); L = running max (l.16). Diagnostic only: L does not
    enter the tau rule (§III-B2 uses it only to check Theorem 1's premise). Each L_{k-1} is
    computed as soon as its inputs exist (end of round k-1, so the server keeps one
    gradient and one model, not two of each) and folded into L in round k, when
    Algorithm 1 computes it.
 4. k >= 1: A_(k,i) = eta beta^2 delta (non-finite -> +inf), m_k = min_j A_(k,j).
 5. tau_(k+1,i) = clamp(floor(A / (A - alpha m_k) + tau_floor_tol), tau_min, tau_max)  (15)
    in the form r_i = A_i / m_k, tau = r / (r - alpha) (eta cancels), with our handling of
    the degenerate cases the paper leaves open:
    m_k <= 1e-12 gives a zero-A client r = 1 (floor(1/(1-alpha)) steps) and the others
    r = inf (tau_min); non-finite A gives tau_min. tau_floor_tol = 1e-9 makes the argmin
    client get 20 at alpha = 0.95, not the 19 of float64 rounding. tau_max (the paper's
    max tau = 50, §IV-A4) is the final clamp.
    k = 0: no estimates; tau_(1,i) = tau_(0,i) = tau_init (Alg. 1 l.24-26), so rounds 1 and
    2 run tau_init and the first adaptive tau is tau_(2,i).
 6. Logged per round: tau (executed), beta, delta, A, the "direction" sign of
    A - alpha m (§III-A defines it; nothing branches on it), the per-round L_{k-1}
    ("L_round") and the running max L, tau_eff = tau_k, tau_next = sum p_i tau_(k+1,i)
    (after the reset, see above), eta tau_next L (Theorem 1's premise, >= 1, plotted in
    Fig. 4) and the condition eta tau_next (2L + alpha m) < 4, which the proof of
    Theorem 2 (App. A) also needs and the paper never checks.

Single-exchange protocol, and why it is the paper's protocol
-------------------------------------------------------------------
The paper's round k has two exchanges (Alg. 1 l.3-10): (1) server -> client w_k, tau_(k,i);
client -> server grad F_i(w_k), G_(k,i); (2) for k >= 1 server -> client the vector
grad F(w_{k-1}) (d floats); the client computes beta, delta; client -> server beta, delta.
Here one exchange carries everything:

    down (Task):   w_k (d floats), tau_(k,i) (= Task.train["steps"]), and for k >= 1 the
                   scalar gn2 = ||grad F(w_{k-1})||^2 (Task.scalars["gn2"])
    up (Update):   w^tau_(k,i) and grad F_i(w_k) (2d floats), steps, a_norm, and for
                   k >= 1 beta, delta

The results are identical because (a) the client uses grad F(w_{k-1}) only through its
squared norm (Alg. 2 l.17; beta does not use it at all), and that vector is fixed at the end
of round k-1, before w_k is sent, so the scalar can travel with w_k; (b) the statistics the
estimators need are recorded during the tau steps either way (the paper's client must keep
them until the second message arrives); (c) w_{k+1} does not depend on beta or delta, and
tau_(k+1,i) depends only on them and alpha, so when they arrive does not change any value.
Uploading w^tau instead of G_(k,i) is the same d floats (the server computes G from it,
(5)); tests/test_fedveca.py replays the two-exchange order and checks equality.
Traffic per client and round: d down + 2d up, against 2d down + 2d up in the paper.

Other points the paper leaves open, and edgefl's choices: tau_init = 10 (tau_(0,i) is not
given; it must be >= 2 for the estimators' ranges to be non-empty), batch size from `train`
(not given); the paper's one-round-stale grad F(w_{k-1}) in delta is kept (it is what makes
the single exchange possible); `alpha_clamp: true` uses alpha_eff = min(alpha, (1 - 1e-6)
2L / m_k) when L is finite (Theorem 2's range for alpha_k; the paper fixes alpha = 0.95);
local momentum is allowed and then normalised by FedNova's ||a_i||_1 (the paper uses plain
SGD); weight decay is rejected (the kernels' step statistics see the loss gradient only, so
beta and delta would not describe the steps taken). With partial participation (not in the
paper, which is synchronous) p_i is renormalised over the uploaders, the rule's
min runs over them, and clients that did not take part keep their tau; rounds with fewer
uploads than clients carry "partial_participation": true. `adapt: false` keeps every
tau_i = tau_init (FedNova with FedVeca's estimates logged).

The server state is w_k, grad F(w_{k-1}), w_{k-1}, the tau table and the scalars
(gn2, L, the pending L estimate): everything a checkpoint needs. The client keeps no state;
its tau comes with each task.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from .. import kernels
from . import (WEIGHTINGS, Strategy, StrategyError, Task, Update, check_choice, check_number,
               exact_weights, mean_train_loss, number_scalars, register, weighted_average)
from .fednova import checked_norms, normalizer, nova_coefficients

EPS = 1e-12                  # our guard for norms, denominators and min A near zero
DELTA_VARIANTS = ("alg2", "theory")
GRAD_AT_GLOBAL = ("batch", "full")


# ---------------------------------------------------------------------------------------
# the estimators (client, Alg. 2 l.15-18) and the step-size rule (server, (15), Alg. 1 l.17)
# ---------------------------------------------------------------------------------------

def estimate_beta_delta(step_stats: np.ndarray, gn2: float | None, lr: float,
                        delta_variant: str = "alg2"):
    """(beta, delta) of one local round from `kernels.local_train`'s step statistics
    (rows s = 0..tau-1: ||grad0 - g^s||, ||w_k - w^s||, ||sum_{r<=s} g^r||^2, each before
    step s's update), Alg. 2 l.15-18 (s = 0 is 0/0 and skipped; two readings of delta):

    beta  = max over s in [1, tau-1] with ||w_k - w^s|| > 1e-12 of ||grad0 - g^s|| / ||w_k - w^s||
            (0 when no step qualifies; s = 0 is 0/0)
    delta = max over s in [1, tau-1] of ||sum_{r<=s} g^r||^2 / ((s+1) gn2)       (alg2)
                                     or ||w_k - w^s||^2 / (eta^2 s gn2)          (theory)
            None when gn2 is None (round k = 0), 0 when gn2 <= 1e-12.

    Non-finite statistics give non-finite estimates, which the rule maps to tau_min."""
    st = np.asarray(step_stats, dtype=np.float64)
    if st.ndim != 2 or st.shape[1] != 3:
        raise StrategyError(f"fedveca: step statistics of shape {st.shape}, need (steps, 3)")
    check_choice("fedveca", "delta_variant", delta_variant, DELTA_VARIANTS)
    s = np.arange(1, st.shape[0], dtype=np.float64)
    grad_gap, dist, run_sq = st[1:, 0], st[1:, 1], st[1:, 2]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        moved = ~(dist <= EPS)                   # NaN distances stay in, as NaN
        beta = float(np.max(grad_gap[moved] / dist[moved])) if moved.any() else 0.0
        if gn2 is None:
            return beta, None
        gn2 = float(gn2)
        if not gn2 > EPS or s.size == 0 or (delta_variant == "theory" and not lr > 0):
            return beta, 0.0 if math.isfinite(gn2) else float("nan")
        if delta_variant == "alg2":
            delta = float(np.max(run_sq / ((s + 1.0) * gn2)))
        else:
            delta = float(np.max(dist * dist / (lr * lr * s * gn2)))
    return beta, delta


def noniid_coefficient(lr: float, beta: float, delta: float) -> float:
    """A = eta beta^2 delta (Theorem 1); +inf when it is not a finite number (our guard)."""
    with np.errstate(over="ignore", invalid="ignore"):
        a = float(np.float64(lr) * np.float64(beta) * np.float64(beta) * np.float64(delta))
    return a if math.isfinite(a) and a >= 0 else float("inf")


def next_steps(A: Mapping[int, float], alpha: float, tau_min: int = 2, tau_max: int = 50,
               tau_floor_tol: float = 1e-9) -> dict:
    """{client: tau_(k+1,i)} from {client: A_(k,i)}, rule (15) with reset and cap
    (Alg. 1 l.17-21; the cap is §IV-A4's max tau; the degenerate cases are ours):

        r_i = A_i / m (m = min_j A_j);   tau = clamp(floor(r / (r - alpha) + tol), tau_min, tau_max)

    m <= 1e-12: r = 1 for clients with A <= 1e-12, inf otherwise; r = inf gives tau_min;
    non-finite or negative A count as +inf. With tau_min = 2 the clamp is the paper's
    "tau <= 1 -> 2". Invariant under A -> cA (c > 0), hence under eta."""
    if not 0 < alpha < 1:
        raise StrategyError(f"fedveca: alpha = {alpha!r} must be in (0, 1)")
    a = {c: (float(v) if v is not None and math.isfinite(v) and v >= 0 else math.inf)
         for c, v in A.items()}
    if not a:
        return {}
    m = min(a.values())
    out = {}
    for c in sorted(a):
        if math.isinf(m):
            r = math.inf
        elif m > EPS:
            r = a[c] / m
        else:
            r = 1.0 if a[c] <= EPS else math.inf
        t = math.floor(r / (r - alpha) + tau_floor_tol) if math.isfinite(r) else 1
        out[c] = int(min(max(t, tau_min), tau_max))
    return out


def baseline_steps(tau_all: int, rounds: int, sizes) -> list:
    """The FedAvg/FedNova baselines' fixed local steps (the paper's §IV-A1):
    tau_i = floor((tau_all / K) D_i / D), with tau_all the total local iterations of all
    clients over the K rounds of the FedVeca run it is compared with (exact integer
    arithmetic: floor(tau_all D_i / (K D)))."""
    sizes = [int(n) for n in sizes]
    total = sum(sizes)
    if rounds < 1 or total <= 0 or min(sizes) < 0:
        raise StrategyError(f"fedveca: baseline_steps needs rounds >= 1 and sizes > 0, "
                            f"got rounds={rounds}, sizes={sizes[:10]}")
    return [int(tau_all) * n // (int(rounds) * total) for n in sizes]


# ---------------------------------------------------------------------------------------
# the strategy
# ---------------------------------------------------------------------------------------

@register("fedveca")
@dataclass(frozen=True)
class FedVeca(Strategy):
    secure_sum = False
    secure_sum_refusal = "its step sizes come from each client's gradient and the angles between the clients' updates"
    alpha: float = 0.95
    tau_init: int = 10
    tau_min: int = 2
    tau_max: int = 50
    tau_floor_tol: float = 1e-9
    delta_variant: str = "alg2"
    grad_at_global: str = "batch"
    adapt: bool = True
    alpha_clamp: bool = False
    weighting: str = "samples"

    def __post_init__(self):
        check_number("fedveca", "alpha", self.alpha, 0.0, 1.0, lo_open=True, hi_open=True,
                     why="the control parameter alpha_k, 0.95 in the paper's §IV-A4")
        _check_int("tau_min", self.tau_min, 2, 10 ** 6, "delta needs steps s >= 1")
        _check_int("tau_max", self.tau_max, self.tau_min, 10 ** 6, "at least tau_min")
        _check_int("tau_init", self.tau_init, self.tau_min, self.tau_max,
                   "the steps of rounds 1 and 2")
        check_number("fedveca", "tau_floor_tol", self.tau_floor_tol, 0.0, 0.5, hi_open=True,
                     why="added before the floor of rule (15); 0 mimics naive float64")
        check_choice("fedveca", "delta_variant", self.delta_variant, DELTA_VARIANTS)
        check_choice("fedveca", "grad_at_global", self.grad_at_global, GRAD_AT_GLOBAL)
        _check_bool("adapt", self.adapt)
        _check_bool("alpha_clamp", self.alpha_clamp)
        check_choice("fedveca", "weighting", self.weighting, WEIGHTINGS)

    # ---------------------------------------------------------------- server half
    def init(self, global_params, cfg):
        if cfg.train.get("weight_decay", 0.0):
            raise StrategyError(f"fedveca: train.weight_decay = {cfg.train['weight_decay']} is "
                                f"not supported: FedVeca is plain SGD on the loss (the "
                                f"paper's rule (1)) and its beta/delta estimators see the loss "
                                f"gradient only; use an L2 model option instead")
        steps = cfg.train.get("steps", 0)
        if steps and steps != self.tau_init:
            raise StrategyError(f"fedveca: train.steps = {steps} conflicts with strategy "
                                f"tau_init = {self.tau_init}; FedVeca sets every client's local "
                                f"steps itself: set strategy tau_init and leave train.steps unset")
        state = super().init(global_params, cfg)
        return state.replace(tau={str(c): self.tau_init for c in cfg.clients},
                             gn2=None, L=None, L_pending=None)

    def configure(self, round, clients, state):
        """One broadcast model; per-client steps tau_(k,i) in Task.train; from round 2 on the
        scalar gn2 = ||grad F(w_{k-1})||^2 (the single-exchange protocol, module docstring)."""
        setup = self.setup(state)
        tau = state.meta["tau"]
        unknown = sorted(int(c) for c in clients if str(int(c)) not in tau)
        if unknown:
            raise StrategyError(f"fedveca: selected client(s) {unknown} are not in the federation")
        shared = {"params": state.buffers["params"]}
        scalars = {} if state.meta["gn2"] is None else {"gn2": state.meta["gn2"]}
        return {c: Task(round, shared,
                        self.local_config(setup, round, c, steps=tau[str(c)],
                                          grad0_mode=self.grad_at_global),
                        scalars=scalars)
                for c in sorted(clients)}

    def aggregate(self, round, updates, state):
        setup = self.setup(state)
        clients, exact = exact_weights(updates, self.weighting)
        for name in ("params", "grad0"):
            missing = [c for c in clients if name not in updates[c].buffers]
            if missing:
                raise StrategyError(f"fedveca: update of client(s) {missing} has no {name!r} "
                                    f"buffer (got {sorted(updates[missing[0]].buffers)})")
        estimated = state.meta["gn2"] is not None
        momentum = self.local_config(setup, round, clients[0])["momentum"]
        norms = checked_norms("fedveca", updates, clients, momentum)
        if estimated:
            beta = number_scalars("fedveca", updates, "beta", clients)
            delta = number_scalars("fedveca", updates, "delta", clients)
        w_k = state.buffers["params"]
        p = [float(q) for q in exact]

        # (5) w_{k+1} = w_k - eta tau_k d_k, as FedNova's weighted sum of the uploads
        coeffs, residual, tau_eff = nova_coefficients(exact, norms)
        buffers = [updates[c].buffers["params"] for c in clients]
        factors = [float(c) for c in coeffs]
        if residual != 0:
            buffers.append(w_k)
            factors.append(float(residual))
        params = weighted_average(buffers, factors)
        grad = weighted_average([updates[c].buffers["grad0"] for c in clients], p)     # (8)
        gn2 = kernels.sqnorm(grad)

        lr = setup.lr(round)
        taus = dict(state.meta["tau"])
        L = state.meta["L"]
        metrics = {"train_loss": mean_train_loss(updates),
                   "tau": {c: updates[c].steps for c in clients}, "tau_eff": float(tau_eff),
                   "grad_norm": math.sqrt(gn2)}
        if len(clients) < len(setup.clients):
            metrics["partial_participation"] = True
        if estimated:                                                   # k >= 1
            L_round = state.meta["L_pending"]
            if L_round is not None and not math.isnan(L_round):
                L = L_round if L is None else max(L, L_round)
            A = {c: noniid_coefficient(lr, beta[c], delta[c]) for c in clients}
            m = min(A.values())
            alpha = self.alpha
            if self.alpha_clamp and L is not None and math.isfinite(L) and L > 0 \
                    and math.isfinite(m) and m > EPS:
                alpha = min(alpha, (1 - 1e-6) * 2 * L / m)
            rule = next_steps(A, alpha, self.tau_min, self.tau_max, self.tau_floor_tol)
            if self.adapt:
                taus.update({str(c): t for c, t in rule.items()})
            tau_next = sum(q * taus[str(c)] for q, c in zip(p, clients))
            metrics.update({
                "beta": beta, "delta": delta, "A": A,
                "direction": {c: _sign(A[c] - alpha * m) for c in clients},
                "alpha_eff": alpha, "L_round": L_round, "L": L, "tau_next": tau_next,
                "eta_tau_L": None if L is None else lr * tau_next * L,
                "thm2_condition": None if L is None or not math.isfinite(m)
                else bool(lr * tau_next * (2 * L + alpha * m) < 4)})
        # L_k for the next round (folded in then, as Alg. 1 computes it one round late)
        if "grad_prev" in state.buffers:
            L_pending = _ratio(_distance(grad, state.buffers["grad_prev"]),
                               _distance(w_k, state.buffers["params_prev"]))
        else:                                                           # L_0, Alg. 1 l.12
            L_pending = _ratio(math.sqrt(gn2), math.sqrt(kernels.sqnorm(w_k)))
        new_state = state.replace({"params": params, "grad_prev": grad, "params_prev": w_k},
                                  round=round, tau=taus, gn2=gn2, L=L, L_pending=L_pending)
        return new_state, metrics

    # ---------------------------------------------------------------- client half
    def train(self, task, local_data, client_state):
        """tau plain SGD steps from w_k (momentum optional) recording grad F_i(w_k)
        and, when the task carries gn2 (k >= 1), the step statistics for beta and delta."""
        cfg = dict(task.train)
        if cfg["steps"] < 1:
            raise StrategyError(f"fedveca: task for round {task.round} has no local steps "
                                f"(train.steps = {cfg['steps']})")
        params = np.array(task.buffers["params"], dtype=np.float32, copy=True)
        grad0 = np.empty_like(params)
        gn2 = task.scalars.get("gn2")
        stats = np.zeros((cfg["steps"], 3), dtype=np.float64) if gn2 is not None else None
        momentum = np.zeros_like(params) if cfg["momentum"] > 0 else None
        result = kernels.train_samples(local_data.samples, params, cfg, momentum=momentum,
                                       grad0=grad0, step_stats=stats, stop=local_data.stop)
        scalars = {"a_norm": normalizer(result["steps"], cfg["momentum"])}
        if stats is not None:
            scalars["beta"], scalars["delta"] = estimate_beta_delta(stats, gn2, cfg["lr"],
                                                                    self.delta_variant)
        buffers = {"params": params, "grad0": grad0} if task.upload else {}
        update = Update(buffers, local_data.num_samples, result["mean_loss"], result["steps"],
                        scalars)
        return update, client_state


def _check_int(key: str, value, lo: int, hi: int, why: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise StrategyError(f"strategy 'fedveca': {key} = {value!r} must be an integer in "
                            f"[{lo}, {hi}] ({why})")


def _check_bool(key: str, value) -> None:
    if not isinstance(value, bool):
        raise StrategyError(f"strategy 'fedveca': {key} = {value!r}; valid: true, false")


def _distance(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b))


def _ratio(num: float, den: float):
    """num / den, or None when the denominator is below 1e-12 (then the estimate is skipped)."""
    return num / den if den >= EPS else None


def _sign(x: float) -> int:
    return 1 if x > 0 else (-1 if x < 0 else 0)
