"""DUW's weight table Theta (T rounds x K clients) and its parametrisation, and the weight
file that carries a trained table from `edgefl duw-train` to the runs that use it.

The table is parametrised as Theta_k^(t) = phi_{k,t}^2 / sum_l phi_{l,t}^2 (the authors'
code), so every row stays on the simplex whatever step the optimiser takes; phi starts at
sqrt(N_k / N), i.e. the table starts at FedAvg's weights.
"""
from __future__ import annotations

import json
import os
from fractions import Fraction
from typing import Mapping, Sequence

import numpy as np

from ... import __version__, kernels
from ...errors import ConfigError
from ...io import jsonable, write_json
from .. import Setup, StrategyError

FORMAT = "edgefl-duw-weights"
FORMAT_VERSION = 1
WEIGHTS_FILE = "duw_weights.json"   # the name of a run's trained table in its output directory
SIMPLEX_TOLERANCE = 1e-9            # |sum_k Theta_k^(t) - 1| accepted in a given table


# ---------------------------------------------------------------------------------------
# the table and its parametrisation
# ---------------------------------------------------------------------------------------

def initial_table(num_samples: Sequence[int], rounds: int) -> np.ndarray:
    """(T, K) float64 table with every row the correctly rounded N_k / N (the paper's
    eq. (3)): the table before any meta-step, identical to the weights FedAvg's
    `aggregation_weights` computes, so DUW with M = 0 reproduces FedAvg bit for bit."""
    counts = [int(n) for n in num_samples]
    total = sum(counts)
    if not counts or total <= 0 or min(counts) <= 0:
        raise StrategyError(f"duw: sample counts {counts} cannot weight an average")
    row = [float(Fraction(n, total)) for n in counts]
    return np.tile(np.array(row, dtype=np.float64), (int(rounds), 1))


def initial_phi(num_samples: Sequence[int], rounds: int) -> np.ndarray:
    """(T, K) raw parameters phi_{k,t} = sqrt(N_k / N) (the authors' code)."""
    counts = np.asarray(num_samples, dtype=np.float64)
    return np.tile(np.sqrt(counts / counts.sum()), (int(rounds), 1))


def theta_from_phi(phi: np.ndarray) -> np.ndarray:
    """Theta_k^(t) = phi_{k,t}^2 / sum_l phi_{l,t}^2 per round (row), sum guarded at 1e-12.
    Invariant to scaling a row of phi and to the signs of phi."""
    sq = np.square(np.asarray(phi, dtype=np.float64))
    return sq / np.maximum(sq.sum(axis=1, keepdims=True), 1e-12)


def as_list(key: str, value) -> list:
    """`value` of DUW parameter `key` as a list with one entry per client (or per round)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, np.ndarray)):
        raise StrategyError(f"strategy 'duw': {key} = {value!r} must be a list with one entry "
                            f"per client")
    if len(value) == 0:
        raise StrategyError(f"strategy 'duw': {key} = [] must have one entry per client")
    return list(value)


def check_table(table) -> tuple:
    """A given table as a tuple of T rows of K floats: non-negative, finite, every row
    summing to 1 within SIMPLEX_TOLERANCE (DUW uses the rows without renormalising)."""
    rows = as_list("table", table)
    try:
        arr = np.array([[float(v) for v in as_list("table", row)] for row in rows],
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


# ---------------------------------------------------------------------------------------
# the weight file
# ---------------------------------------------------------------------------------------

def weights_document(trained, strategy, setup: Setup, config: Mapping | None = None) -> dict:
    """The JSON document of a weight file for a `TrainedTable` of `strategy` (a DUW): the
    table with its client ids and T, the meta-loss curve, the environment and the config
    it was trained under."""
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
        "config": None if config is None else jsonable(config),
    }


def save_weights(path: str | os.PathLike, document: Mapping) -> str:
    """Write the document with edgefl.io.write_json (atomic, durable once returned) into a
    directory made if missing; returns the path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json(path, document)
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
        table = check_table(doc["table"])
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


def check_document(doc: dict, path: str, base: str, beyond_horizon: str, setup: Setup,
                   sizes: list) -> None:
    """A loaded weight file against the run that is to use it: the same clients with the
    same sample counts, the same base algorithm, and enough rounds (unless beyond_horizon
    is mean)."""
    if doc["clients"] != list(setup.clients) or doc["num_samples"] != list(sizes):
        raise ConfigError(f"{path}: the weight table was trained for clients {doc['clients']} "
                          f"with {doc['num_samples']} samples, but this run has clients "
                          f"{list(setup.clients)} with {list(sizes)}; train one for this "
                          f"partition with `edgefl duw-train`")
    if doc.get("base", "fedavg") != base:
        raise ConfigError(f"{path}: the weights were trained for base = {doc.get('base')} but "
                          f"strategy.base = {base} (valid: fedavg, fednova)")
    T = len(doc["table"])
    if setup.rounds > T and beyond_horizon == "error":
        raise ConfigError(f"{path}: the weight table covers rounds 1..{T} but rounds = "
                          f"{setup.rounds}; retrain for rounds = {setup.rounds}, or set "
                          f"strategy.beyond_horizon = mean (valid: error, mean)")
