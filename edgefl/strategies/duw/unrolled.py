"""DUW's offline phase: learn the T x K aggregation-weight table by unrolled simulation
(Nakai-Kasai & Wadayama, arXiv 2212.12191, Alg. 3).

Why this loop is its own and not the round engine's (the rounds `edgefl simulate` and the
aggregator run): it differentiates through the rounds. The hypergradient needs every round's
local models w_k^(t), global models w^(t) and sums of all minibatch gradients S^(t) of the
whole T-round run at once (float64; or the whole run in float64 through the NumPy reference,
for finite-difference checks), and clients whose upload fails must still evaluate their
gradients; a round engine runs one round, aggregates and forgets it. The FL run that uses the
table is an ordinary run of the DUW strategy, and `unroll` with iteration None reproduces it
bit for bit (tests/test_duw.py), so the two loops cannot drift apart unnoticed.

One meta-iteration m simulates the whole T-round FL run of the target environment (the
clients' data, E_k, p_k, the initial model w^(0)) with the current weights, exactly as
`edgefl.strategies.duw.DUW` runs it, and accumulates

    L(Theta) = sum_{t=0..T} sum_k sum_s l(b_{k,t,s}; w_{k,t}^s)

the sum of the per-minibatch mean training losses of every local step of every client in
rounds 0..T-1 (at the iterate before the step), plus round T: E_k epochs of minibatch losses
of the final global model w^(T) on every client's data (without it Theta^(T-1) gets no
gradient). Losses of clients whose upload fails are included: their gradients are
evaluated at w^(t) and they do not move. The loss is the model's own training loss,
cross-entropy for the classifiers, as in the authors' code (the paper's text says MSE,
which an MSE model would give). With train.weight_decay > 0 the kernels' gradient sums include
the decay term, so the FO gradient is that of L + (wd/2) sum ||w_{k,t}^s||^2 while the
recorded meta-loss is L alone (the paper uses no weight decay).

Hypergradient: first-order (FO, the authors' code: local gradients detached).
With S^(t) = sum of ALL minibatch gradients evaluated in round t (`local_train`'s grad_sum)
and R^(t) = sum_{t' >= t} S^(t'),

    dL/dTheta_k^(t) = <w_k^(t), R^(t+1)>
    dL/dphi_{k,t}   = 2 phi_{k,t} / sum_l phi_{l,t}^2 * <w_k^(t) - w^(t+1), R^(t+1)>

K*T dot products per meta-iteration, nothing beyond the forward simulation. The exact
reverse-mode hypergradient (Hessian-vector products) is not implemented; FO is what
reproduces the paper.

Optimiser: Adam (beta1 0.9, beta2 0.999, eps 1e-8, PyTorch's bias correction) on phi,
lr `meta_lr`, one step per meta-iteration, all T rounds trained jointly from m = 0 -- no
incremental (layer-by-layer) training, no lr schedule, clipping or early stopping. The
meta-update runs in float64; the simulation in float32 through the kernels, or in float64
through the NumPy reference (`dtype=np.float64`, the oracle for finite-difference checks).

Randomness (streams.py): meta-iteration m draws fresh shuffles and drop patterns from
streams keyed by (seed, m, round, client) and, inside local_train, the epoch; the FL run
(iteration None) uses the run's own streams. The initial model is the same for every m.
Runs are bit-for-bit reproducible whatever the number of threads: clients are
simulated independently and combined in sorted id order.
"""
from __future__ import annotations

import hashlib
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from ... import kernels, reference
from ...errors import NonFiniteError
from .. import LocalData, Setup, StrategyError, client_seed
from .streams import meta_seed, uploads
from .table import initial_phi, initial_table, theta_from_phi

__all__ = ["Unrolled", "unroll", "hypergradient", "Adam", "TrainedTable", "train_table",
           "sorted_clients", "progress_reporter"]

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


# ---------------------------------------------------------------------------------------
# the unrolled FL run
# ---------------------------------------------------------------------------------------

@dataclass
class Unrolled:
    """One simulated T-round run: what the FO hypergradient needs.

    meta_loss: L, the meta-loss (module docstring).
    grad_sums: S^(t), t = 0..T, shape (T+1, d), float64.
    locals:    w_k^(t), shape (T, K, d), float64 (w^(t) itself for a failed upload).
    globals:   w^(t), t = 0..T, shape (T+1, d), float64 (values of the simulation's dtype).
    uploaded:  c_k^(t), shape (T, K), bool.
    losses:    per round t = 0..T the sum of its minibatch losses, shape (T+1,).
    """
    meta_loss: float
    grad_sums: np.ndarray
    locals: np.ndarray
    globals: np.ndarray
    uploaded: np.ndarray
    losses: np.ndarray

    @property
    def final(self) -> np.ndarray:
        return self.globals[-1]


def sorted_clients(clients: Mapping[int, LocalData], setup: Setup) -> list:
    """The clients' LocalData in setup.clients order (the table's columns)."""
    missing = sorted(set(setup.clients) - set(clients))
    if missing:
        raise StrategyError(f"duw: no local data for client(s) {missing[:10]}")
    return [clients[c] for c in setup.clients]


def _local(data: LocalData, params: np.ndarray, cfg: dict, grad_sum: np.ndarray) -> dict:
    """One local round in place on params (float32: the kernels; float64: the reference)."""
    if params.dtype == np.float32:
        momentum = np.zeros_like(params) if cfg["momentum"] > 0 else None
        return kernels.train_samples(data.samples, params, cfg, momentum=momentum,
                                     grad_sum=grad_sum, stop=data.stop)
    labels, targets = kernels.labels_and_targets(data.model, data.y, data.x.shape[0])
    momentum = np.zeros_like(params) if cfg["momentum"] > 0 else None
    return reference.local_train(params, momentum, data.model, data.x, labels, targets, cfg,
                                 grad_sum=grad_sum)


def _combine(out: np.ndarray, buffers: list, weights: np.ndarray) -> np.ndarray:
    """sum_k weights[k] buffers[k] in k order with float64 accumulation: the kernels'
    weighted_sum (what the FL run's aggregation calls) for float32, NumPy for float64."""
    if out.dtype == np.float32:
        return kernels.weighted_sum(out, buffers, weights)
    acc = weights[0] * buffers[0]
    for w, b in zip(weights[1:], buffers[1:]):
        acc = acc + w * b
    out[...] = acc
    return out


def unroll(strategy, setup: Setup, clients: Mapping[int, LocalData], init: np.ndarray,
           theta: np.ndarray, iteration: int | None, *, dtype=np.float32,
           pool: ThreadPoolExecutor | None = None) -> Unrolled:
    """Simulate the T = setup.rounds round FL run of `strategy` (a DUW) with weights `theta` (T x K,
    clients in setup.clients order) from `init`, drawing meta-iteration `iteration`'s
    shuffles and drops (None: the FL run's own, so the final model is the one
    `run_federation` produces, bit for bit in float32). The loop body of the paper's Alg. 3."""
    data = sorted_clients(clients, setup)
    ids = list(setup.clients)
    T, K = int(setup.rounds), len(ids)
    theta = np.asarray(theta, dtype=np.float64)
    if theta.shape != (T, K):
        raise StrategyError(f"duw: weights of shape {theta.shape}, need (rounds, clients) = "
                            f"({T}, {K})")
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise StrategyError(f"duw: simulation dtype {dtype}; valid: float32, float64")
    sizes = {c: d.num_samples for c, d in zip(ids, data)}
    epochs = strategy.epochs_of(setup)
    probs = strategy.upload_probs(setup)
    n = init.size
    grad_sums = np.zeros((T + 1, n))
    locals_ = np.empty((T, K, n))
    globals_ = np.empty((T + 1, n))
    uploaded = np.zeros((T, K), dtype=bool)
    losses = np.zeros(T + 1)
    w = np.array(init, dtype=dtype, copy=True)
    globals_[0] = w

    def run_one(k, cfg, start, r):
        v = start.copy()
        gs = np.zeros_like(v)
        try:
            result = _local(data[k], v, cfg, gs)
        except NonFiniteError as exc:
            where = "FL run" if iteration is None else f"meta-iteration {iteration}"
            raise NonFiniteError(exc.step, f"duw {where}, round {r}, client {ids[k]}: {exc}") \
                from exc
        return v, gs, result["mean_loss"] * result["steps"]

    def run_all(cfgs, start, r):
        jobs = [(k, cfgs[k], start, r) for k in range(K)]
        if pool is None:
            return [run_one(*job) for job in jobs]
        return list(pool.map(lambda job: run_one(*job), jobs))

    for r in range(1, T + 1):
        t = r - 1
        up = uploads(setup.seed, r, ids, probs, iteration)
        cfgs = strategy.round_configs(setup, r, up, sizes, iteration)
        # a failed upload: gradients at w^(t), no step (the code's stop-gradient branch)
        cfgs = [cfgs[c] if up[c] else dict(cfgs[c], lr=0.0, momentum=0.0) for c in ids]
        results = run_all(cfgs, w, r)
        out = []
        for k, (v, gs, loss) in enumerate(results):
            uploaded[t, k] = up[ids[k]]
            if not uploaded[t, k]:
                v = w            # w_k^(t) = w^(t) (bit-identical: lr 0 leaves v unchanged)
            locals_[t, k] = v
            grad_sums[t] += gs
            losses[t] += loss
            out.append(v)
        w = _combine(np.empty_like(w), out, theta[t])
        globals_[r] = w

    # round T: evaluation only, E_k epochs of minibatch losses and gradients at w^(T)
    evals = []
    for c in ids:
        seed = client_seed(setup.seed, T + 1, c) if iteration is None else \
            meta_seed(setup.seed, iteration, T + 1, c)
        overrides = {"lr": 0.0, "momentum": 0.0, "seed": seed}
        if epochs:
            overrides.update(epochs=epochs[c], steps=0)
        evals.append(strategy.local_config(setup, T + 1, c, **overrides))
    for _, gs, loss in run_all(evals, w, T + 1):
        grad_sums[T] += gs
        losses[T] += loss
    return Unrolled(float(losses.sum()), grad_sums, locals_, globals_, uploaded, losses)


def hypergradient(unrolled: Unrolled, phi: np.ndarray):
    """(dL/dphi, dL/dTheta), both (T, K) float64, by the FO closed form (module docstring): one
    reverse sweep of suffix sums R^(t+1) and K dot products per round."""
    S, W, G = unrolled.grad_sums, unrolled.locals, unrolled.globals
    T = W.shape[0]
    phi = np.asarray(phi, dtype=np.float64)
    grad_phi = np.zeros((T, W.shape[1]))
    grad_theta = np.zeros((T, W.shape[1]))
    R = S[T].copy()                              # R^(T)
    for t in range(T - 1, -1, -1):               # R holds R^(t+1)
        grad_theta[t] = W[t] @ R
        norm = max(float(np.sum(phi[t] ** 2)), 1e-12)
        grad_phi[t] = 2.0 * phi[t] / norm * ((W[t] - G[t + 1]) @ R)
        R += S[t]
    return grad_phi, grad_theta


class Adam:
    """Adam with PyTorch's defaults and bias correction, float64, descent."""

    def __init__(self, shape, lr: float, betas=ADAM_BETAS, eps: float = ADAM_EPS):
        self.lr, (self.b1, self.b2), self.eps = float(lr), betas, float(eps)
        self.m = np.zeros(shape)
        self.v = np.zeros(shape)
        self.steps = 0

    def step(self, params: np.ndarray, grad: np.ndarray) -> np.ndarray:
        """The new parameters (a new array)."""
        self.steps += 1
        self.m = self.b1 * self.m + (1 - self.b1) * grad
        self.v = self.b2 * self.v + (1 - self.b2) * grad * grad
        c1 = 1 - self.b1 ** self.steps
        c2 = 1 - self.b2 ** self.steps
        denom = np.sqrt(self.v) / math.sqrt(c2) + self.eps
        return params - (self.lr / c1) * self.m / denom


# ---------------------------------------------------------------------------------------
# training the table (the paper's Alg. 3)
# ---------------------------------------------------------------------------------------

@dataclass
class TrainedTable:
    """table: Theta (T x K, rows on the simplex) after M Adam steps; phi: the raw
    parameters behind it; meta_loss[m]: L at meta-iteration m (with the weights before its
    step); clients / num_samples: column ids and N_k; init_sha256: of w^(0)."""
    table: np.ndarray
    phi: np.ndarray
    meta_loss: list
    clients: tuple
    num_samples: tuple
    init_sha256: str
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)


def train_table(strategy, setup: Setup, clients: Mapping[int, LocalData], init: np.ndarray,
                *, dtype=np.float32, workers: int = 1,
                on_iteration: Callable[[int, np.ndarray, Unrolled, np.ndarray], None] | None = None
                ) -> TrainedTable:
    """Run strategy.meta_iterations meta-iterations (unrolled run, FO hypergradient, one
    Adam step on phi) for the T = setup.rounds round environment. `on_iteration(m, theta,
    unrolled, grad_phi)` sees every meta-iteration (theta: the weights simulated)."""
    if setup.rounds < 1:
        raise StrategyError("duw: the weight table needs rounds >= 1 (T, the unrolled depth)")
    started = time.perf_counter()
    data = sorted_clients(clients, setup)
    sizes = tuple(d.num_samples for d in data)
    strategy.epochs_of(setup)
    strategy.upload_probs(setup)
    T = int(setup.rounds)
    phi = initial_phi(sizes, T)
    theta = initial_table(sizes, T)          # exactly N_k / N before the first step
    adam = Adam(phi.shape, strategy.meta_lr)
    losses = []
    workers = max(1, int(workers))
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="edgefl-duw") \
        if workers > 1 and len(data) > 1 else None
    try:
        for m in range(strategy.meta_iterations):
            unrolled = unroll(strategy, setup, clients, init, theta, m, dtype=dtype, pool=pool)
            grad_phi, _ = hypergradient(unrolled, phi)
            if not np.all(np.isfinite(grad_phi)):
                raise NonFiniteError(m, f"duw meta-iteration {m}: non-finite hypergradient")
            losses.append(unrolled.meta_loss)
            if on_iteration is not None:
                on_iteration(m, theta, unrolled, grad_phi)
            phi = adam.step(phi, grad_phi)
            theta = theta_from_phi(phi)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    return TrainedTable(theta, phi, losses, tuple(setup.clients), sizes,
                        hashlib.sha256(np.ascontiguousarray(init).tobytes()).hexdigest(),
                        time.perf_counter() - started)


def progress_reporter(total: int, stream):
    """One progress line per ~10% of the meta-iterations (none when stream is None)."""
    if stream is None or total == 0:
        return None
    every = max(1, total // 10)
    started = time.perf_counter()

    def report(m, theta, unrolled, grad_phi):
        if (m + 1) % every == 0 or m + 1 == total:
            elapsed = time.perf_counter() - started
            stream.write(f"duw meta-iteration {m + 1}/{total} meta-loss {unrolled.meta_loss:.4f} "
                         f"{elapsed:.1f}s\n")
            stream.flush()
    return report
