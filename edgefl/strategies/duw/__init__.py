"""DUW: Nakai-Kasai, Wadayama, "Deep Unfolding-based Weighted Averaging for Federated Learning
in Heterogeneous Environments" (arXiv 2212.12191). Federated learning with a learned,
round-dependent table of aggregation weights Theta (T rounds x K clients, the paper's
eq. (19)). The table is learned offline, before the run, by the strategy's `prepare` hook
(unrolled.py: unrolled simulation, first-order hypergradient, Adam; the paper's Alg. 3),
called by `edgefl simulate` and by `edgefl duw-train`.

    __init__.py  the strategy (the FL run with a table) and its offline phase `prepare`
    table.py     the table, its parametrisation and the weight file
    streams.py   the random streams (data order of the meta-training, upload draws)
    unrolled.py  the unrolled simulation, its hypergradient and the table's training

Every client trains every round (DUW excludes client selection) and the server sets

    w^(t+1) = sum_k Theta_k^(t) w_k^(t)                                             (19)

with the table row of round t, unchanged: no renormalisation, and a client whose upload
failed contributes the broadcast model w^(t) with its full weight (as the authors' code
does). Client k runs E_k local epochs (`local_epochs`, computational heterogeneity); its
upload gets through with probability p_k (`upload_prob`, communication heterogeneity, drawn
per (seed, round, client) from a stream of its own, streams.py). A client whose upload is
drawn to fail does not train: its result would be discarded and the aggregate is the same.

base:
  fedavg   local SGD with the run's lr (DUW-FedAvg, the paper's Alg. 1 with line 5
           replaced by (19)).
  fednova  DUW-FedNova as the authors' code does it: client k's local lr is
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
the table is exactly N_k / N (the correctly rounded ratios FedAvg uses), so DUW-FedAvg
is FedAvg bit for bit -- and, with `local_epochs` / `upload_prob` set, it is the paper's
FedAvg baseline in that environment (failed uploads substituted by w^(t)).

Where the paper leaves a choice open (non-paper behaviour is marked so):
  - Theta_k^(t) = phi_{k,t}^2 / sum_l phi_{l,t}^2, phi initialised to sqrt(N_k / N)
    (authors' code), guard sum >= 1e-12. Before the first meta-step the table is the
    correctly rounded N_k / N itself (not phi^2 / sum phi^2, which differs by round-off).
  - the meta-training starts from the run's initial model (same w^(0) in both phases,
    the authors' MNIST setup); `meta_init_seed` starts it from model.init(seed) instead.
  - drop-outs are simulated from p_k in both phases; losses of dropped clients enter
    the meta-loss (the table is trained in a server-side simulation).
  - the table covers rounds 1..T only. beyond_horizon: error (default; retrain with
    the new T, the faithful option) or mean (non-paper: use the time average
    theta_k = mean_t Theta_k^(t), the objective weights of the paper's Theorem 1). A run
    shorter than T uses the first rows (DUW's gain is largest at round T).
  - the meta-loss, its range, the first-order gradient and the streams: see unrolled.py.
  - defaults are the paper's values (M = 400, meta lr 0.001); the authors' code's
    alternates (e.g. 0.0005 for DUW-FedNova) are settings of meta_lr / meta_iterations.
  - tau_k = E_k * ceil(N_k / B) (the authors' evaluation script), Alg. 5's loop bound
    read as 0..tau-1.
  - not implemented: a balanced validation set, early stopping (the paper's lr and M are
    kept), distributed meta-training (the table is trained in a server-side simulation
    over the clients' data).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Mapping, Sequence

import numpy as np

from ... import kernels
from ...errors import ConfigError
from .. import (PrepareContext, Setup, State, Strategy, StrategyError, Task, Update,
                check_choice, check_number, local_round, mean_train_loss, register,
                update_buffers, weighted_average)
from ..fednova import normalizer
from .streams import meta_seed, uploads
from .table import (SIMPLEX_TOLERANCE, WEIGHTS_FILE, as_list, check_document, check_table,
                    initial_phi, initial_table, load_weights, save_weights, theta_from_phi,
                    weights_document)
from .unrolled import (Adam, TrainedTable, Unrolled, hypergradient, progress_reporter,
                       sorted_clients, train_table, unroll)

__all__ = ["DUW", "BASES", "HORIZONS", "SIMPLEX_TOLERANCE", "WEIGHTS_FILE", "initial_table",
           "initial_phi", "theta_from_phi", "meta_seed", "uploads", "Unrolled", "unroll",
           "hypergradient", "Adam", "TrainedTable", "train_table", "weights_document",
           "save_weights", "load_weights"]

BASES = ("fedavg", "fednova")
HORIZONS = ("error", "mean")


# ---------------------------------------------------------------------------------------
# the strategy
# ---------------------------------------------------------------------------------------

@register("duw")
@dataclass(frozen=True)
class DUW(Strategy):
    """DUW-FedAvg / DUW-FedNova.

    base:            fedavg | fednova, the FL algorithm the weights are learned for and used with.
    weights:         a weight file written by `edgefl duw-train` (a relative path: beside the
                     config file, else in the working directory).
    meta_iterations: M, Adam steps of the meta-training (paper 400-1000).
    meta_lr:         Adam's learning rate on phi (paper 0.001; the code uses 0.0005 for
                     DUW-FedNova).
    local_epochs:    E_k per client (sorted ids), or None for train.epochs everywhere.
    upload_prob:     p_k per client, or None for perfect communication.
    meta_init_seed:  None: meta-train from the run's initial model; an int: from
                     model.init(meta_init_seed).
    beyond_horizon:  error | mean, what rounds after the table's T use.
    table:           the T x K weights (rows sum to 1), filled by `prepare` from `weights`
                     or by meta-training; may be given inline.
    num_samples:     N_k per client, filled with the table (DUW-FedNova's tau_eff needs it
                     before the round starts).
    """
    secure_sum = False
    secure_sum_refusal = "it learns a weight for each client's update from the updates themselves"
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
            probs = as_list("upload_prob", self.upload_prob)
            for p in probs:
                check_number("duw", "upload_prob", p, 0, 1,
                             why=f"each p_k is a probability; got {list(probs)}")
            object.__setattr__(self, "upload_prob", tuple(float(p) for p in probs))
        if self.table is not None:
            object.__setattr__(self, "table", check_table(self.table))
            if self.num_samples is not None and len(self.num_samples) != len(self.table[0]):
                raise StrategyError(f"strategy 'duw': num_samples = has {len(self.num_samples)} "
                                    f"entries for a table of {len(self.table[0])} clients")

    # ---------------------------------------------------------------- the offline phase
    def prepare(self, init_params, clients, setup: Setup,
                context: PrepareContext | None = None) -> "DUW":
        """This strategy with its table (the `Strategy.prepare` hook):

        - table given inline: unchanged;
        - weights: the file (`context.resolve`: a relative path is looked up beside the
          config file first, then in the working directory, so
          `--set strategy.weights=runs/x/duw_weights.json` works with a built-in config),
          checked against this federation (client ids, sample counts, base, horizon);
        - neither: meta-trained here on the clients' data (unrolled.train_table, a
          server-side simulation), and the weight file written where the context says
          (`context.output(WEIGHTS_FILE)`: the run's out_dir/duw_weights.json, or
          `edgefl duw-train --out`), so the table can be reused with
          `--set strategy.weights=...`.
        Environment lists of the wrong length raise StrategyError without a context and
        ConfigError naming `context.where` with one."""
        self.check_environment(setup, context)
        context = context or PrepareContext()
        data = sorted_clients(clients, setup)
        sizes = [d.num_samples for d in data]
        if self.table is not None:
            return self
        if self.weights is not None:
            path = context.resolve(self.weights)
            doc = load_weights(path)
            check_document(doc, path, self.base, self.beyond_horizon, setup, sizes)
            return self.with_table(np.array(doc["table"]), sizes)
        init = init_params
        if self.meta_init_seed is not None:
            init = data[0].model.init(self.meta_init_seed)
        trained = train_table(self, setup, clients, init, workers=context.workers,
                              on_iteration=progress_reporter(self.meta_iterations,
                                                             context.stream))
        out = context.output(WEIGHTS_FILE)
        if out is not None:
            save_weights(out, weights_document(trained, self, setup, context.record))
        return self.with_table(trained.table, sizes)

    def check_environment(self, setup: Setup, context: PrepareContext | None) -> None:
        """Before round 1, against this federation: every client takes part in every round
        (clients_per_round), and the per-client lists (local_epochs, upload_prob) have one
        entry per client. Raises StrategyError without a context and ConfigError naming
        `context.where` with one. (DR-FedAvg, a subclass, runs in the same environment.)"""
        if context is not None and context.clients_per_round is not None \
                and context.clients_per_round != len(setup.clients):
            who = "DUW" if self.name == "duw" else self.name
            raise ConfigError(f"{context.where}: clients_per_round: {who} needs every client in "
                              f"every round (its environment is indexed by client); set it to "
                              f"partition.clients = {len(setup.clients)}")
        try:
            self.epochs_of(setup)
            self.upload_probs(setup)
        except StrategyError as exc:
            if context is None:
                raise
            raise ConfigError(f"{context.where}: {exc}") from None

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
        mu tau_eff^(t) / ||a_k||_1. Shared by the FL run and the unrolled simulation,
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
        table's T the time average (beyond_horizon: mean)."""
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
                                f"table is indexed by client); got {len(clients)} of "
                                f"{len(setup.clients)} -- set clients_per_round to "
                                f"{len(setup.clients)}")
        uploaded = uploads(setup.seed, round, setup.clients, self.upload_probs(setup))
        sizes = dict(zip(setup.clients, self.num_samples)) if self.num_samples else {}
        cfgs = self.round_configs(setup, round, uploaded, sizes)
        shared = {"params": state.buffers["params"]}
        return {c: Task(round, shared, cfgs[c], upload=uploaded[c]) for c in setup.clients}

    def aggregate(self, round, updates, state):
        """(19) over every client of the federation, in sorted id order; a client without an
        update contributes the current global model w^(t) with its full weight."""
        setup = self.federation_of(updates, state)
        return self.weighted_step(round, updates, state, setup, self.weights_of(round))

    def federation_of(self, updates, state):
        """The run's Setup, once every update is checked to come from its federation."""
        setup = self.setup(state)
        stray = sorted(set(updates) - set(setup.clients))
        if stray:
            raise StrategyError(f"strategy '{self.name}': updates from clients {stray} outside "
                                f"the federation {list(setup.clients)}")
        return setup

    def weighted_step(self, round, updates, state, setup, theta, **metrics):
        """(19): sum_k theta_k w_k over every client in sorted id order, w^(t) standing in
        for a client whose upload failed; `metrics` join the round's."""
        current = state.buffers["params"]
        uploaded = dict(zip(sorted(updates), update_buffers(updates, "params", sorted(updates))))
        buffers = [uploaded.get(c, current) for c in setup.clients]
        params = weighted_average(buffers, theta)
        metrics = {"train_loss": mean_train_loss(updates),
                   "dropped": [c for c in setup.clients if c not in updates],
                   "theta": [float(v) for v in theta], **metrics}
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


def _int_list(key: str, value, lo: int):
    if value is None:
        return None
    items = as_list(key, value)
    for v in items:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < lo:
            raise StrategyError(f"strategy 'duw': {key} = {items!r}: every entry must be an "
                                f"integer >= {lo}")
    return tuple(int(v) for v in items)


def _check_length(key: str, values, setup: Setup) -> None:
    if len(values) != len(setup.clients):
        raise StrategyError(f"strategy 'duw': {key} = {list(values)} has {len(values)} entries "
                            f"for {len(setup.clients)} clients")


def _horizon_message(table_rounds: int, rounds: int) -> str:
    return (f"strategy 'duw': the weight table covers {table_rounds} rounds but round {rounds} "
            f"was asked for; retrain it for rounds = {rounds}, or set beyond_horizon = mean "
            f"(valid: {', '.join(HORIZONS)}) to use its time average")
