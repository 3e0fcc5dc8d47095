"""DUW: Nakai-Kasai, Wadayama, "Deep Unfolding-based Weighted Averaging for Federated Learning
in Heterogeneous Environments" (arXiv 2212.12191; specs/duw.md). This module is Phase 2
(§2.8): federated learning with a learned, round-dependent table of aggregation weights
Theta (T rounds x K clients, eq. (19)); the table itself is learned offline in Phase 1 by
`edgefl.duw_train` (unrolled simulation, first-order hypergradient, Adam; §2.4-§2.7, §3).

Every client trains every round (DUW excludes client selection, §2.10) and the server sets

    w^(t+1) = sum_k Theta_k^(t) w_k^(t)                                             (19)

with the table row of round t, unchanged: no renormalisation, and a client whose upload
failed contributes the broadcast model w^(t) with its full weight (§2.4, the authors' code;
§9 item 13). Client k runs E_k local epochs (`local_epochs`, computational heterogeneity);
its upload gets through with probability p_k (`upload_prob`, communication heterogeneity,
drawn per (seed, round, client) from a stream of its own, §2.10). A client whose upload is
drawn to fail does not train: its result would be discarded and the aggregate is the same.

base (§2.9):
  fedavg   local SGD with the run's lr (DUW-FedAvg, Alg. 1 with line 5 replaced by (19)).
  fednova  DUW-FedNova as the authors' code does it (§2.9, §8.10): client k's local lr is
           mu * tau_eff^(t) / ||a_k||_1 with tau_k = E_k * ceil(N_k / B) local steps
           (||a_k||_1 = tau_k for plain SGD, fednova.normalizer for local momentum) and
           tau_eff^(t) = sum_j (N_j / N) c_j^(t) ||a_j||_1 over the clients whose upload gets
           through this round (c_j^(t) = 1) -- this round's drop pattern is known before
           the round, oracle knowledge that only a simulation has. Then (19). Summing
           Theta_k = N_k / N this is FedNova's update w - tau_eff sum_k (N_k/N) mu d_k with the
           normalisation moved into the local step size.

Weights: `table` (rows = rounds 1..T, columns = clients in sorted id order) is normally not
written by hand: `strategy: {name: duw, weights: FILE}` loads the file `edgefl duw-train`
wrote, and `strategy: {name: duw}` without one trains the table first in the same run
(`DUW.prepare`, called by `edgefl.sim.simulate` before round 1). With `meta_iterations: 0`
the table is exactly N_k / N (the correctly rounded ratios FedAvg uses, §2.3), so DUW-FedAvg
is FedAvg bit for bit -- and, with `local_epochs` / `upload_prob` set, it is the paper's
FedAvg baseline in that environment (failed uploads substituted by w^(t), §2.4).

Resolutions of specs/duw.md §8 (non-paper behaviour is marked so):
  §8.1  Theta_k^(t) = phi_{k,t}^2 / sum_l phi_{l,t}^2, phi initialised to sqrt(N_k / N)
        (authors' code), guard sum >= 1e-12. Before the first meta-step the table is the
        correctly rounded N_k / N itself (not phi^2 / sum phi^2, which differs by round-off).
  §8.5  the meta-training starts from the run's initial model (same w^(0) in both phases,
        the authors' MNIST setup); `meta_init_seed` starts it from model.init(seed) instead.
  §8.7  drop-outs are simulated from p_k in both phases; losses of dropped clients enter
        the meta-loss (server-side simulation, §2.11 (i)).
  §8.8  the table covers rounds 1..T only. beyond_horizon: error (default; retrain with
        the new T, the faithful option) or mean (non-paper: use the time average
        theta_k = mean_t Theta_k^(t), the objective weights of Theorem 1). A run shorter
        than T uses the first rows (DUW's gain is largest at round T, §9 item 14).
  §8.2-§8.4, §8.6  see edgefl.duw_train (meta-loss, its range, FO gradient, streams).
  §8.9  defaults are the paper's values (M = 400, meta lr 0.001); the code's alternates
        (e.g. 0.0005 for DUW-FedNova) are settings of meta_lr / meta_iterations.
  §8.10 tau_k = E_k * ceil(N_k / B) (evaluation script), Alg. 5's loop bound read as
        0..tau-1.
  §8.12, §8.16, §8.17  not implemented: no balanced validation set, no early stopping (the
        paper's lr and M are kept), no distributed meta-training (Phase 1 is a server-side
        simulation over the clients' data, §2.11 (i)).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Mapping, Sequence

import numpy as np

from .. import kernels
from . import (Setup, State, Strategy, StrategyError, Task, Update, check_choice, check_number,
               local_round, mean_train_loss, register, weighted_average)
from .fednova import normalizer

BASES = ("fedavg", "fednova")
HORIZONS = ("error", "mean")
SIMPLEX_TOLERANCE = 1e-9        # |sum_k Theta_k^(t) - 1| accepted in a given table

_DROP_STREAM = 0xD809           # upload success draws c_k^(t) ~ Bernoulli(p_k)
_META_STREAM = 0xDE7A           # data order of the meta-training's local rounds
_DEPLOY = 0                     # iteration code of the FL run (meta-iteration m has m + 1)


# ---------------------------------------------------------------------------------------
# the table and its parametrisation (§2.3)
# ---------------------------------------------------------------------------------------

def initial_table(num_samples: Sequence[int], rounds: int) -> np.ndarray:
    """(T, K) float64 table with every row the correctly rounded N_k / N (eq. (3)): the
    table before any meta-step, identical to the weights FedAvg's `aggregation_weights`
    computes, so DUW with M = 0 reproduces FedAvg bit for bit (§9 item 2)."""
    counts = [int(n) for n in num_samples]
    total = sum(counts)
    if not counts or total <= 0 or min(counts) <= 0:
        raise StrategyError(f"duw: sample counts {counts} cannot weight an average")
    row = [float(Fraction(n, total)) for n in counts]
    return np.tile(np.array(row, dtype=np.float64), (int(rounds), 1))


def initial_phi(num_samples: Sequence[int], rounds: int) -> np.ndarray:
    """(T, K) raw parameters phi_{k,t} = sqrt(N_k / N) (§2.3, authors' code)."""
    counts = np.asarray(num_samples, dtype=np.float64)
    return np.tile(np.sqrt(counts / counts.sum()), (int(rounds), 1))


def theta_from_phi(phi: np.ndarray) -> np.ndarray:
    """Theta_k^(t) = phi_{k,t}^2 / sum_l phi_{l,t}^2 per round (row), sum guarded at 1e-12
    (§2.3, §8.1). Invariant to scaling a row of phi and to the signs of phi."""
    sq = np.square(np.asarray(phi, dtype=np.float64))
    return sq / np.maximum(sq.sum(axis=1, keepdims=True), 1e-12)


# ---------------------------------------------------------------------------------------
# random streams (§3.4 (4)): one per (iteration, round, client); epochs inside the kernel
# ---------------------------------------------------------------------------------------

def meta_seed(seed: int, iteration: int, round: int, client: int) -> int:
    """Data-order seed of `client`'s local round `round` in meta-iteration `iteration`
    (0-based; round T+1 is the evaluation-only pass). local_train draws epoch e's shuffle
    from (this seed, e), so every (meta-iteration, round, client, epoch) has its own stream,
    independent of thread scheduling, and different from the FL run's `client_seed`s."""
    ss = np.random.SeedSequence((int(seed), _META_STREAM, int(iteration), int(round), int(client)))
    return int(ss.generate_state(1, np.uint64)[0])


def uploads(seed: int, round: int, clients: Sequence[int], upload_prob: Sequence[float] | None,
            iteration: int | None = None) -> dict:
    """{client: upload gets through} for round `round`: c_k ~ Bernoulli(p_k), one draw from a
    Generator seeded by (seed, iteration, round, client); iteration None is the FL run,
    an int the meta-iteration (each draws a fresh pattern, §2.4, §8.6). p = None: all True."""
    if upload_prob is None:
        return {int(c): True for c in clients}
    code = _DEPLOY if iteration is None else int(iteration) + 1
    out = {}
    for c, p in zip(clients, upload_prob):
        rng = np.random.default_rng((int(seed), _DROP_STREAM, code, int(round), int(c)))
        out[int(c)] = bool(rng.random() < p)
    return out


# ---------------------------------------------------------------------------------------
# the strategy
# ---------------------------------------------------------------------------------------

@register("duw")
@dataclass(frozen=True)
class DUW(Strategy):
    """DUW-FedAvg / DUW-FedNova (§2.8-§2.9).

    base:            fedavg | fednova, the FL algorithm the weights are learned for and used with.
    weights:         a weight file written by `edgefl duw-train` (a relative path: beside the
                     config file, else in the working directory).
    meta_iterations: M, Adam steps of the meta-training (§2.7; paper 400-1000).
    meta_lr:         Adam's learning rate on phi (paper 0.001; the code uses 0.0005 for
                     DUW-FedNova, §8.9).
    local_epochs:    E_k per client (sorted ids), or None for train.epochs everywhere.
    upload_prob:     p_k per client, or None for perfect communication.
    meta_init_seed:  None: meta-train from the run's initial model (§8.5); an int: from
                     model.init(meta_init_seed).
    beyond_horizon:  error | mean, what rounds after the table's T use (§8.8).
    table:           the T x K weights (rows sum to 1), filled by `prepare` from `weights`
                     or by meta-training; may be given inline.
    num_samples:     N_k per client, filled with the table (DUW-FedNova's tau_eff needs it
                     before the round starts).
    """
    base: str = "fedavg"
    weights: str | None = None
    meta_iterations: int = 400
    meta_lr: float = 0.001
    local_epochs: tuple | None = None
    upload_prob: tuple | None = None
    meta_init_seed: int | None = None
    beyond_horizon: str = "error"
    table: tuple | None = None
    num_samples: tuple | None = None

    def __post_init__(self):
        check_choice("duw", "base", self.base, BASES)
        check_choice("duw", "beyond_horizon", self.beyond_horizon, HORIZONS)
        if self.weights is not None and (not isinstance(self.weights, str) or not self.weights):
            raise StrategyError(f"strategy 'duw': weights = {self.weights!r} must be the path of "
                                f"a weight file from `edgefl duw-train`")
        if self.weights is not None and self.table is not None:
            raise StrategyError("strategy 'duw': weights = and table = both given; give one")
        _check_int("meta_iterations", self.meta_iterations, 0)
        check_number("duw", "meta_lr", self.meta_lr, 0, math.inf, lo_open=True, hi_open=True)
        if self.meta_init_seed is not None:
            _check_int("meta_init_seed", self.meta_init_seed, 0)
        object.__setattr__(self, "local_epochs", _int_list("local_epochs", self.local_epochs, 1))
        object.__setattr__(self, "num_samples", _int_list("num_samples", self.num_samples, 1))
        if self.upload_prob is not None:
            probs = _as_list("upload_prob", self.upload_prob)
            for p in probs:
                check_number("duw", "upload_prob", p, 0, 1,
                             why=f"each p_k is a probability; got {list(probs)}")
            object.__setattr__(self, "upload_prob", tuple(float(p) for p in probs))
        if self.table is not None:
            object.__setattr__(self, "table", _check_table(self.table))
            if self.num_samples is not None and len(self.num_samples) != len(self.table[0]):
                raise StrategyError(f"strategy 'duw': num_samples = has {len(self.num_samples)} "
                                    f"entries for a table of {len(self.table[0])} clients")

    # ---------------------------------------------------------------- the offline phase
    def prepare(self, init_params, clients, setup: Setup, *, config=None, out_dir=None,
                stream=None, workers: int = 1) -> "DUW":
        """This strategy with its table: as given, loaded from `weights`, or meta-trained on
        the clients' data (Phase 1, server-side simulation, §2.11 (i)); see
        edgefl.duw_train.prepare_strategy."""
        from ..duw_train import prepare_strategy

        return prepare_strategy(self, init_params, clients, setup, config=config,
                                out_dir=out_dir, stream=stream, workers=workers)

    def with_table(self, table: np.ndarray, num_samples: Sequence[int]) -> "DUW":
        """A copy using `table` (T x K) and the clients' sample counts."""
        rows = tuple(tuple(float(v) for v in row) for row in np.asarray(table))
        return dataclasses.replace(self, weights=None, table=rows,
                                   num_samples=tuple(int(n) for n in num_samples))

    # ---------------------------------------------------------------- environment
    def epochs_of(self, setup: Setup) -> dict:
        """{client: E_k}, or {} when every client uses the setup's train section."""
        if self.local_epochs is None:
            return {}
        _check_length("local_epochs", self.local_epochs, setup)
        if int(setup.train.get("steps", 0)) > 0:
            raise StrategyError("strategy 'duw': local_epochs = per-client epochs conflict with "
                                f"train.steps = {setup.train['steps']}; use train.epochs")
        return dict(zip(setup.clients, self.local_epochs))

    def upload_probs(self, setup: Setup):
        if self.upload_prob is not None:
            _check_length("upload_prob", self.upload_prob, setup)
        return self.upload_prob

    def round_configs(self, setup: Setup, round: int, uploaded: Mapping[int, bool],
                      num_samples: Mapping[int, int], iteration: int | None = None) -> dict:
        """{client: kernels.train_config} of round `round` (1-based) for every client: the
        setup's train section, E_k, the data-order seed (the FL run's `client_seed` when
        iteration is None, else `meta_seed`) and, for base fednova, the local lr
        mu tau_eff^(t) / ||a_k||_1 (§2.9). Shared by the FL run and the unrolled simulation,
        so both run the same local rounds."""
        epochs = self.epochs_of(setup)
        cfgs = {}
        for c in setup.clients:
            overrides = {"epochs": epochs[c], "steps": 0} if epochs else {}
            if iteration is not None:
                overrides["seed"] = meta_seed(setup.seed, iteration, round, c)
            cfgs[c] = self.local_config(setup, round, c, **overrides)
        if self.base == "fednova":
            norms = {c: Fraction(normalizer(kernels.planned_steps(cfgs[c], int(num_samples[c])),
                                            cfgs[c]["momentum"])) for c in setup.clients}
            total = sum(int(num_samples[c]) for c in setup.clients)
            tau_eff = sum(Fraction(int(num_samples[c]), total) * norms[c]
                          for c in setup.clients if uploaded[c])
            for c in setup.clients:
                cfgs[c] = dict(cfgs[c], lr=float(Fraction(cfgs[c]["lr"]) * tau_eff / norms[c]))
        return cfgs

    # ---------------------------------------------------------------- server half
    def init(self, global_params, cfg: Setup) -> State:
        if self.table is None:
            raise StrategyError("strategy 'duw': no weight table; give strategy.weights (a file "
                                "from `edgefl duw-train`), or run it with `edgefl simulate`, "
                                "which trains the table first")
        if len(self.table[0]) != len(cfg.clients):
            raise StrategyError(f"strategy 'duw': the weight table has {len(self.table[0])} "
                                f"clients but the federation has {len(cfg.clients)}")
        if self.base == "fednova" and self.num_samples is None:
            raise StrategyError("strategy 'duw': base = fednova needs num_samples (N_k) with the "
                                "table to compute tau_eff before each round")
        if cfg.rounds > len(self.table) and self.beyond_horizon == "error":
            raise StrategyError(_horizon_message(len(self.table), cfg.rounds))
        self.epochs_of(cfg)
        self.upload_probs(cfg)
        return super().init(global_params, cfg)

    def weights_of(self, round: int) -> np.ndarray:
        """The K weights of round `round` (1-based): row round-1 of the table, or after the
        table's T the time average (beyond_horizon: mean, §8.8)."""
        table = np.asarray(self.table, dtype=np.float64)
        if round <= len(table):
            return table[round - 1]
        if self.beyond_horizon == "mean":
            return table.mean(axis=0)
        raise StrategyError(_horizon_message(len(table), round))

    def configure(self, round, clients, state):
        setup = self.setup(state)
        if sorted(clients) != list(setup.clients):
            raise StrategyError(f"strategy 'duw': every client takes part in every round (the "
                                f"table is indexed by client, §2.10); got {len(clients)} of "
                                f"{len(setup.clients)} -- set clients_per_round to "
                                f"{len(setup.clients)}")
        uploaded = uploads(setup.seed, round, setup.clients, self.upload_probs(setup))
        sizes = dict(zip(setup.clients, self.num_samples)) if self.num_samples else {}
        cfgs = self.round_configs(setup, round, uploaded, sizes)
        shared = {"params": state.buffers["params"]}
        return {c: Task(round, shared, cfgs[c], upload=uploaded[c]) for c in setup.clients}

    def aggregate(self, round, updates, state):
        """(19) over every client of the federation, in sorted id order; a client without an
        update contributes the current global model w^(t) with its full weight (§2.4)."""
        setup = self.setup(state)
        stray = sorted(set(updates) - set(setup.clients))
        if stray:
            raise StrategyError(f"strategy 'duw': updates from clients {stray} outside the "
                                f"federation {list(setup.clients)}")
        theta = self.weights_of(round)
        current = state.buffers["params"]
        buffers = [updates[c].buffers["params"] if c in updates else current
                   for c in setup.clients]
        params = weighted_average(buffers, theta)
        metrics = {"train_loss": mean_train_loss(updates),
                   "dropped": [c for c in setup.clients if c not in updates],
                   "theta": [float(v) for v in theta]}
        return state.replace({"params": params}, round=round), metrics

    # ---------------------------------------------------------------- client half
    def train(self, task, local_data, client_state):
        if not task.upload:     # the upload will not get through: nothing to compute
            return Update({}, local_data.num_samples, float("nan"), 0), client_state
        params, _, result = local_round(local_data, task.buffers["params"], task.train)
        return (Update({"params": params}, local_data.num_samples, result["mean_loss"],
                       result["steps"]), client_state)


# ---------------------------------------------------------------------------------------
# parameter checks
# ---------------------------------------------------------------------------------------

def _check_int(key: str, value, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise StrategyError(f"strategy 'duw': {key} = {value!r} must be an integer >= {lo}")


def _as_list(key: str, value) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, np.ndarray)):
        raise StrategyError(f"strategy 'duw': {key} = {value!r} must be a list with one entry "
                            f"per client")
    if len(value) == 0:
        raise StrategyError(f"strategy 'duw': {key} = [] must have one entry per client")
    return list(value)


def _int_list(key: str, value, lo: int):
    if value is None:
        return None
    items = _as_list(key, value)
    for v in items:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < lo:
            raise StrategyError(f"strategy 'duw': {key} = {items!r}: every entry must be an "
                                f"integer >= {lo}")
    return tuple(int(v) for v in items)


def _check_length(key: str, values, setup: Setup) -> None:
    if len(values) != len(setup.clients):
        raise StrategyError(f"strategy 'duw': {key} = {list(values)} has {len(values)} entries "
                            f"for {len(setup.clients)} clients")


def _check_table(table) -> tuple:
    rows = _as_list("table", table)
    try:
        arr = np.array([[float(v) for v in _as_list("table", row)] for row in rows],
                       dtype=np.float64)
    except (TypeError, ValueError):
        raise StrategyError("strategy 'duw': table = must be T rows of K numbers (rounds x "
                            "clients)") from None
    if arr.ndim != 2:
        raise StrategyError("strategy 'duw': table = rows have different lengths; need T rows "
                            "of K numbers")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise StrategyError("strategy 'duw': table = has negative or non-finite weights")
    sums = arr.sum(axis=1)
    bad = np.flatnonzero(np.abs(sums - 1) > SIMPLEX_TOLERANCE)
    if bad.size:
        raise StrategyError(f"strategy 'duw': table = row {int(bad[0]) + 1} sums to "
                            f"{sums[bad[0]]!r}, not 1 (Theta is used without renormalisation)")
    return tuple(tuple(float(v) for v in row) for row in arr)


def _horizon_message(table_rounds: int, rounds: int) -> str:
    return (f"strategy 'duw': the weight table covers {table_rounds} rounds but round {rounds} "
            f"was asked for; retrain it for rounds = {rounds}, or set beyond_horizon = mean "
            f"(valid: {', '.join(HORIZONS)}) to use its time average (specs/duw.md §8.8)")
