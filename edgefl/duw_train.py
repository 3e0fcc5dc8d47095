"""DUW Phase 1: learn the T x K aggregation-weight table offline by unrolled simulation
(Nakai-Kasai & Wadayama, arXiv 2212.12191, Alg. 3; specs/duw.md §2.4-§2.7, §2.12, §3).

One meta-iteration m simulates the whole T-round FL run of the target environment (the
clients' data, E_k, p_k, the initial model w^(0)) with the current weights, exactly as
`edgefl.strategies.duw.DUW` runs it, and accumulates

    L(Theta) = sum_{t=0..T} sum_k sum_s l(b_{k,t,s}; w_{k,t}^s)                      (§2.5)

the sum of the per-minibatch mean training losses of every local step of every client in
rounds 0..T-1 (at the iterate before the step), plus round T: E_k epochs of minibatch losses
of the final global model w^(T) on every client's data (without it Theta^(T-1) gets no
gradient, §8.3). Losses of clients whose upload fails are included: their gradients are
evaluated at w^(t) and they do not move (§2.4). The loss is the model's own training loss,
cross-entropy for the classifiers, as in the authors' code (§8.2; the paper's text says MSE,
which an MSE model would give). With train.weight_decay > 0 the kernels' gradient sums include
the decay term, so the FO gradient is that of L + (wd/2) sum ||w_{k,t}^s||^2 while the
recorded meta-loss is L alone (the paper uses no weight decay).

Hypergradient: first-order (FO, §2.6 (a), the authors' code: local gradients detached).
With S^(t) = sum of ALL minibatch gradients evaluated in round t (`local_train`'s grad_sum,
§3.4 (1)) and R^(t) = sum_{t' >= t} S^(t'),

    dL/dTheta_k^(t) = <w_k^(t), R^(t+1)>
    dL/dphi_{k,t}   = 2 phi_{k,t} / sum_l phi_{l,t}^2 * <w_k^(t) - w^(t+1), R^(t+1)>

K*T dot products per meta-iteration, nothing beyond the forward simulation (§3.2). The
exact reverse-mode hypergradient (§2.6 (b), Hessian-vector products) is not implemented;
FO is what reproduces the paper (§8.4).

Optimiser (§2.7): Adam (beta1 0.9, beta2 0.999, eps 1e-8, PyTorch's bias correction) on phi,
lr `meta_lr`, one step per meta-iteration, all T rounds trained jointly from m = 0 -- no
incremental (layer-by-layer) training, no lr schedule, clipping or early stopping, as
specified. The meta-update runs in float64 (§3.4); the simulation in float32 through the
kernels, or in float64 through the NumPy reference (`dtype=np.float64`, the oracle for
finite-difference checks).

Randomness (§3.4 (4), §8.6): meta-iteration m draws fresh shuffles and drop patterns from
streams keyed by (seed, m, round, client) and, inside local_train, the epoch; the FL run
(iteration None) uses the run's own streams. The initial model is the same for every m
(§8.5). Runs are bit-for-bit reproducible whatever the number of threads: clients are
simulated independently and combined in sorted id order.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from . import __version__, kernels, reference
from .config import ConfigError
from .errors import NonFiniteError
from .strategies import LocalData, Setup, StrategyError, client_seed
from .strategies.duw import (DUW, initial_phi, initial_table, meta_seed, theta_from_phi,
                             uploads)

__all__ = ["Unrolled", "unroll", "hypergradient", "Adam", "TrainedTable", "train_table",
           "weights_document", "save_weights", "load_weights", "prepare_strategy",
           "train_from_config", "FORMAT", "FORMAT_VERSION"]

FORMAT = "edgefl-duw-weights"
FORMAT_VERSION = 1
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


# ---------------------------------------------------------------------------------------
# the unrolled FL run (§2.4)
# ---------------------------------------------------------------------------------------

@dataclass
class Unrolled:
    """One simulated T-round run: what the FO hypergradient needs (§2.6 (a), §2.12).

    meta_loss: L of §2.5.
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


def _sorted_clients(clients: Mapping[int, LocalData], setup: Setup) -> list:
    missing = sorted(set(setup.clients) - set(clients))
    if missing:
        raise StrategyError(f"duw: no local data for client(s) {missing[:10]}")
    return [clients[c] for c in setup.clients]


def _local(data: LocalData, params: np.ndarray, cfg: dict, grad_sum: np.ndarray) -> dict:
    """One local round in place on params (float32: the kernels; float64: the reference)."""
    if params.dtype == np.float32:
        momentum = np.zeros_like(params) if cfg["momentum"] > 0 else None
        return kernels.train_samples(data.samples, params, cfg, momentum=momentum,
                                     grad_sum=grad_sum)
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


def unroll(strategy: DUW, setup: Setup, clients: Mapping[int, LocalData], init: np.ndarray,
           theta: np.ndarray, iteration: int | None, *, dtype=np.float32,
           pool: ThreadPoolExecutor | None = None) -> Unrolled:
    """Simulate the T = setup.rounds round FL run of `strategy` with weights `theta` (T x K,
    clients in setup.clients order) from `init`, drawing meta-iteration `iteration`'s
    shuffles and drops (None: the FL run's own, so the final model is the one
    `run_federation` produces, bit for bit in float32). §2.4 / §2.12 TRAIN_DUW's loop body."""
    data = _sorted_clients(clients, setup)
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
    """(dL/dphi, dL/dTheta), both (T, K) float64, by the FO closed form of §2.6 (a): one
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
    """Adam with PyTorch's defaults and bias correction (§2.7), float64, descent."""

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
# training the table (Alg. 3, §2.12 TRAIN_DUW)
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


def train_table(strategy: DUW, setup: Setup, clients: Mapping[int, LocalData], init: np.ndarray,
                *, dtype=np.float32, workers: int = 1,
                on_iteration: Callable[[int, np.ndarray, Unrolled, np.ndarray], None] | None = None
                ) -> TrainedTable:
    """Run strategy.meta_iterations meta-iterations (unrolled run, FO hypergradient, one
    Adam step on phi) for the T = setup.rounds round environment. `on_iteration(m, theta,
    unrolled, grad_phi)` sees every meta-iteration (theta: the weights simulated)."""
    if setup.rounds < 1:
        raise StrategyError("duw: the weight table needs rounds >= 1 (T, the unrolled depth)")
    started = time.perf_counter()
    data = _sorted_clients(clients, setup)
    sizes = tuple(d.num_samples for d in data)
    strategy.epochs_of(setup)
    strategy.upload_probs(setup)
    T = int(setup.rounds)
    phi = initial_phi(sizes, T)
    theta = initial_table(sizes, T)          # exactly N_k / N before the first step (§8.1)
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


# ---------------------------------------------------------------------------------------
# the weight file
# ---------------------------------------------------------------------------------------

def weights_document(trained: TrainedTable, strategy: DUW, setup: Setup,
                     config: Mapping | None = None) -> dict:
    """The JSON document of a weight file: the table with its client ids and T (§9 item 15),
    the meta-loss curve, the environment and the config it was trained under."""
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "rounds": int(trained.table.shape[0]),
        "clients": [int(c) for c in trained.clients],
        "num_samples": [int(n) for n in trained.num_samples],
        "base": strategy.base,
        "local_epochs": list(strategy.local_epochs) if strategy.local_epochs else None,
        "upload_prob": list(strategy.upload_prob) if strategy.upload_prob else None,
        "meta_iterations": strategy.meta_iterations,
        "meta_lr": strategy.meta_lr,
        "seed": setup.seed,
        "train": dict(setup.train),
        "lr_decay": setup.lr_decay,
        "init_sha256": trained.init_sha256,
        "table": [[float(v) for v in row] for row in trained.table],
        "phi": [[float(v) for v in row] for row in trained.phi],
        "meta_loss": [float(v) for v in trained.meta_loss],
        "wall_s": trained.wall_s,
        "backend": kernels.backend,
        "edgefl_version": __version__,
        "config": None if config is None else _plain(config),
    }


def save_weights(path: str | os.PathLike, document: Mapping) -> str:
    """Write the document atomically (temporary file, fsync, rename); returns the path."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_plain(document), f, indent=1, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_weights(path: str | os.PathLike) -> dict:
    """A weight file's document, checked: format, version, a (T, K) table on the simplex,
    one client id and sample count per column."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: DUW weight file does not exist (write one with "
                          f"`edgefl duw-train CONFIG --out {path}`)") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not a DUW weight file: invalid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ConfigError(f"{path}: not a DUW weight file (format is not {FORMAT!r})")
    if doc.get("version") != FORMAT_VERSION:
        raise ConfigError(f"{path}: DUW weight file version {doc.get('version')!r}; this edgefl "
                          f"reads version {FORMAT_VERSION}")
    try:
        table = DUW(table=doc["table"]).table
        clients, sizes = list(doc["clients"]), list(doc["num_samples"])
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: DUW weight file lacks or garbles {exc}") from None
    except StrategyError as exc:
        raise ConfigError(f"{path}: {str(exc).replace('strategy ' + repr('duw') + ': ', '')}") \
            from None
    if len(table) != doc.get("rounds") or len(clients) != len(table[0]) \
            or len(sizes) != len(clients):
        raise ConfigError(f"{path}: DUW weight file: table of {len(table)} x {len(table[0])} "
                          f"does not match rounds = {doc.get('rounds')}, {len(clients)} client "
                          f"ids and {len(sizes)} sample counts")
    doc["table"] = table
    return doc


# ---------------------------------------------------------------------------------------
# wiring: `strategy: {name: duw}` in edgefl simulate, and `edgefl duw-train`
# ---------------------------------------------------------------------------------------

def prepare_strategy(strategy: DUW, init_params: np.ndarray, clients: Mapping[int, LocalData],
                     setup: Setup, *, config=None, out_dir=None, stream=None,
                     workers: int = 1) -> DUW:
    """The strategy with its table (`DUW.prepare`):

    - table given inline: unchanged;
    - weights: the file (a relative path is looked up beside the config file first, then
      in the working directory, so `--set strategy.weights=runs/x/duw_weights.json` works
      with a built-in config), checked against this federation (client ids, sample counts,
      base, horizon);
    - neither: meta-trained here on the clients' data; the weight file is also written to
      out_dir/duw_weights.json when out_dir is given, so the table can be reused with
      `--set strategy.weights=...`.
    `config` is the RunConfig (for relative paths, clients_per_round and the file's record)."""
    if config is not None and config.clients_per_round != config.clients:
        raise ConfigError(f"{config.path or '<config>'}: clients_per_round: DUW needs every "
                          f"client in every round (its table is indexed by client, specs/duw.md "
                          f"§2.10); set it to partition.clients = {config.clients}")
    data = _sorted_clients(clients, setup)
    sizes = [d.num_samples for d in data]
    try:                                  # per-client lists against this federation, now
        strategy.epochs_of(setup)
        strategy.upload_probs(setup)
    except StrategyError as exc:
        if config is None:
            raise
        raise ConfigError(f"{config.path or '<config>'}: {exc}") from None
    if strategy.table is not None:
        return strategy
    if strategy.weights is not None:
        path = os.path.expanduser(strategy.weights)
        if config is not None and config.path and not os.path.isabs(path):
            beside = os.path.join(os.path.dirname(os.path.abspath(config.path)), path)
            path = beside if os.path.exists(beside) else path
        doc = load_weights(path)
        _check_document(doc, path, strategy, setup, sizes)
        return strategy.with_table(np.array(doc["table"]), sizes)
    init = init_params
    if strategy.meta_init_seed is not None:
        init = data[0].model.init(strategy.meta_init_seed)
    trained = train_table(strategy, setup, clients, init, workers=workers,
                          on_iteration=_reporter(strategy.meta_iterations, stream))
    if out_dir is not None:
        document = weights_document(trained, strategy, setup,
                                    None if config is None else config.to_dict())
        save_weights(os.path.join(os.fspath(out_dir), "duw_weights.json"), document)
    return strategy.with_table(trained.table, sizes)


def _check_document(doc: dict, path: str, strategy: DUW, setup: Setup, sizes: list) -> None:
    if doc["clients"] != list(setup.clients) or doc["num_samples"] != list(sizes):
        raise ConfigError(f"{path}: the weight table was trained for clients {doc['clients']} "
                          f"with {doc['num_samples']} samples, but this run has clients "
                          f"{list(setup.clients)} with {list(sizes)}; train one for this "
                          f"partition with `edgefl duw-train`")
    if doc.get("base", "fedavg") != strategy.base:
        raise ConfigError(f"{path}: the weights were trained for base = {doc.get('base')} but "
                          f"strategy.base = {strategy.base} (valid: fedavg, fednova)")
    T = len(doc["table"])
    if setup.rounds > T and strategy.beyond_horizon == "error":
        raise ConfigError(f"{path}: the weight table covers rounds 1..{T} but rounds = "
                          f"{setup.rounds}; retrain for rounds = {setup.rounds}, or set "
                          f"strategy.beyond_horizon = mean (valid: error, mean)")


def _reporter(total: int, stream):
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


def train_from_config(config, out: str | os.PathLike, *, workers: int | None = None,
                      stream=None) -> dict:
    """`edgefl duw-train`: meta-train the table for a run config whose strategy is duw and
    write the weight file `out` atomically; returns its document."""
    from .config import dataset_from_config, partition_from_config
    from .errors import KernelError
    from .models import build_model
    from .sim import local_datasets

    where = config.path or "<config>"
    if config.strategy != "duw":
        raise ConfigError(f"{where}: strategy.name: duw-train learns DUW weights; got "
                          f"{config.strategy!r} (set strategy.name = duw)")
    strategy = DUW(**config.strategy_params)
    if strategy.weights is not None or strategy.table is not None:
        key = "weights" if strategy.weights is not None else "table"
        raise ConfigError(f"{where}: strategy.{key}: duw-train writes a new table; remove the "
                          f"key (--set strategy.{key}=)")
    if config.clients_per_round != config.clients:
        raise ConfigError(f"{where}: clients_per_round: DUW needs every client in every round; "
                          f"set it to partition.clients = {config.clients}")
    dataset = dataset_from_config(config.as_config())
    split = partition_from_config(config.as_config(), dataset)
    model_spec = {k: v for k, v in config.model.items() if k != "init"}
    try:
        model = build_model(model_spec, dataset.input_shape, dataset.num_classes)
    except KernelError as exc:
        raise ConfigError(f"{where}: model: {exc}") from None
    init = model.init(config.seed, zero=config.model.get("init") == "zeros")
    if strategy.meta_init_seed is not None:
        init = model.init(strategy.meta_init_seed)
    setup = Setup(clients=range(len(split.indices)), train=config.train.kernel_kwargs(),
                  lr_decay=config.train.lr_decay, seed=config.seed, rounds=config.rounds)
    clients = local_datasets(dataset, split, model)
    workers = (os.cpu_count() or 1) if workers is None else int(workers)
    if workers < 1:
        raise ValueError(f"--workers {workers}: need at least 1 thread")
    trained = train_table(strategy, setup, clients, init, workers=workers,
                          on_iteration=_reporter(strategy.meta_iterations, stream))
    document = weights_document(trained, strategy, setup, config.to_dict())
    save_weights(out, document)
    return document


def _plain(x):
    """JSON types (tuples to lists, NumPy scalars to Python, mappings to dicts)."""
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.ndarray):
        return _plain(x.tolist())
    if isinstance(x, np.generic):
        return x.item()
    return x
