"""The values a strategy works with, and the error it raises: `Setup` (what the server
half knows of a run), `Task` (one client's work in one round), `Update` (what it sends back),
`State` (server or client state, what a checkpoint stores), `LocalData` (a client's samples)
and `PrepareContext` (what an offline phase is given). `Task`, `Update` and `State` make
their buffers read-only on construction (the package's copy-on-write rule)."""
from __future__ import annotations

import dataclasses
import functools
import os
import types
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from .. import kernels


class StrategyError(ValueError):
    """A strategy name, parameter or input the strategy cannot use; the message names it."""

# ---------------------------------------------------------------------------------------
# read-only containers
# ---------------------------------------------------------------------------------------

_F32 = np.dtype(np.float32)


def _frozen_buffers(buffers: Mapping[str, np.ndarray], what: str) -> Mapping[str, np.ndarray]:
    # every Task, Update and State goes through here: a few us each add up in a round of
    # many clients (issue #3's overhead target), hence one flags object per buffer, the
    # identity test on the dtype before the (slower) equality, and the exact-type test
    # before isinstance(Mapping) (an ABC check, ~0.5 us, once per client per round)
    out = {}
    items = buffers.items() if type(buffers) in _PLAIN_MAPPINGS or isinstance(buffers, Mapping) \
        else dict(buffers).items()
    for name, buf in items:
        if not isinstance(buf, np.ndarray) or (buf.dtype is not _F32 and buf.dtype != _F32) \
                or buf.ndim != 1 or not (flags := buf.flags).c_contiguous:
            got = f"{buf.dtype} {buf.shape}" if isinstance(buf, np.ndarray) else type(buf).__name__
            raise StrategyError(f"{what} buffer {name!r}: need a flat contiguous float32 array, "
                                f"got {got}")
        if flags.writeable:
            flags.writeable = False
        out[str(name)] = buf
    return types.MappingProxyType(out)


_PLAIN_MAPPINGS = (dict, types.MappingProxyType)
_EMPTY = types.MappingProxyType({})     # read-only, so every empty mapping can be this one


def _frozen_mapping(mapping) -> Mapping:
    if not mapping:
        return _EMPTY
    return types.MappingProxyType(dict(mapping))


def _nbytes(buffers: Mapping[str, np.ndarray]) -> int:
    """The bytes of a task's or an update's buffers."""
    total = 0           # (a loop, not sum over a generator: read once per client a round)
    for b in buffers.values():
        total += b.nbytes
    return total


@dataclass(frozen=True)
class Setup:
    """What the server half knows about a run when it starts (the `cfg` of `init`).

    clients:  every client id of the federation (FedUmf trains all of them, not only the
              selected ones): sorted; a range 0..N-1 stays a range (and is
              {"start": 0, "stop": N} in `to_json`), any other ids a tuple.
    train:    the base local hyper-parameters, keyword arguments of `kernels.train_config`
              (lr, batch_size, epochs | steps, momentum, weight_decay; no seed).
    lr_decay: per-round factor, eta_t = lr * lr_decay**(t-1) (FedUmf appendix: 0.998).
    seed:     the run seed; each local round's data order is seeded from (seed, round, client).
    rounds:   the planned number of rounds T (0 if open-ended).
    units:    the model's parameter layout by layer, for strategies that work per layer
              (FedMR's layer-wise recombination units): one tuple of (offset, size)
              slices of the flat buffer per layer, in buffer order (`Setup.units_of(model)`);
              empty when the server was not told. `run_federation` fills it in.
    """
    clients: tuple = ()
    train: Mapping = field(default_factory=dict)
    lr_decay: float = 1.0
    seed: int = 0
    rounds: int = 0
    units: tuple = ()

    def __post_init__(self):
        clients = self.clients
        if isinstance(clients, Mapping) and set(clients) == {"start", "stop"}:
            clients = range(int(clients["start"]), int(clients["stop"]))   # to_json's form
        if isinstance(clients, range) and clients.step == 1 and clients.start >= 0:
            # ids 0..N-1, as a run has them: kept as the range (a million clients are not a
            # million objects), already sorted and distinct
            pass
        else:
            clients = tuple(sorted(int(c) for c in clients))
            if len(set(clients)) != len(clients) or any(c < 0 for c in clients):
                raise StrategyError(f"setup.clients: need distinct non-negative ids, "
                                    f"got {clients[:10]}")
        train = dict(self.train)
        if "seed" in train:
            raise StrategyError("setup.train: 'seed' is derived per (round, client); "
                                "set Setup.seed")
        kernels.train_config(**train)   # validates keys and values now, not in round 7
        if not (isinstance(self.lr_decay, (int, float)) and 0 < self.lr_decay <= 1):
            raise StrategyError(f"setup.lr_decay: {self.lr_decay!r} must be in (0, 1]")
        object.__setattr__(self, "clients", clients)
        object.__setattr__(self, "train", _frozen_mapping(train))
        object.__setattr__(self, "lr_decay", float(self.lr_decay))
        object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "rounds", int(self.rounds))
        object.__setattr__(self, "units", tuple(tuple((int(o), int(n)) for o, n in unit)
                                                for unit in self.units))

    def to_json(self) -> dict:
        clients = self.clients
        return {"clients": {"start": clients.start, "stop": clients.stop}
                if isinstance(clients, range) else list(clients), "train": dict(self.train),
                "lr_decay": self.lr_decay, "seed": self.seed, "rounds": self.rounds,
                "units": [[list(s) for s in unit] for unit in self.units]}

    @staticmethod
    def units_of(model) -> tuple:
        """`units` for a Model: its `model.units` (table entry names per layer) as slices."""
        return tuple(tuple((model.table[name].offset, model.table[name].size) for name in unit)
                     for unit in model.units)

    @classmethod
    def from_json(cls, data: Mapping) -> "Setup":
        return cls(**dict(data))

    def lr(self, round: int) -> float:
        """eta_t for round t >= 1."""
        lr = float(self.train.get("lr", kernels.TRAIN_DEFAULTS["lr"]))
        return lr * self.lr_decay ** (round - 1)


@dataclass(frozen=True)
class Task:
    """What the server asks one client to do in one round.

    buffers: the buffers the client starts from, by name ("params", and e.g. "momentum").
    source:  "global" when they are the broadcast global buffers (the same arrays for every
             client; one retained publish on the model topic), "client" when they were made
             for this client alone (FedMR's per-client models; one publish per client).
    upload:  whether the client may upload its result (FedUmf's authorisation); a client
             with upload=False trains, keeps what it needs in its state and sends nothing.
    train:   the resolved local hyper-parameters for this client and round, a
             `kernels.train_config` dict (per-client overrides such as `steps` and the seed
             derived from (seed, round, client) are already in it).
    scalars: strategy-specific numbers sent with the task (e.g. FedVeca's tau).
    """
    round: int
    buffers: Mapping[str, np.ndarray]
    train: Mapping[str, Any]
    source: str = "global"
    upload: bool = True
    scalars: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.source not in ("global", "client"):
            raise StrategyError(f"task.source: {self.source!r}; valid: global, client")
        fields = self.__dict__          # (a frozen dataclass's own fields, set as __init__ does)
        fields["buffers"] = _frozen_buffers(self.buffers, "task")
        fields["train"] = _frozen_mapping(self.train)
        fields["scalars"] = _frozen_mapping(self.scalars)

    @classmethod
    def shared(cls, round: int, buffers: Mapping[str, np.ndarray], trains: Mapping,
               source: str = "global", upload: bool = True,
               scalars: Mapping | None = None) -> dict:
        """{client: Task(round, buffers, train, source, upload, scalars)} for each
        (client, train) of `trains`, the tasks of a round whose clients start from the same
        buffers: the buffers and scalars are checked and frozen once and shared by every
        task (one read-only mapping, as the tasks' `buffers` are the same arrays anyway),
        and each `train` dict is taken over as the task's own (the caller must not keep
        it). The same Tasks as one constructor call per client, without ~2 us of checks
        each: a round of 1,000 clients builds them in one go."""
        if source not in ("global", "client"):
            raise StrategyError(f"task.source: {source!r}; valid: global, client")
        frozen = _frozen_buffers(buffers, "task")
        scalars = _frozen_mapping(scalars)
        proxy, new = types.MappingProxyType, object.__new__
        tasks = {}
        for c, train in trains.items():
            task = new(cls)
            task.__dict__.update(round=round, buffers=frozen, train=proxy(train),
                                 source=source, upload=upload, scalars=scalars)
            tasks[c] = task
        return tasks

    @property
    def nbytes(self) -> int:
        """float32 bytes of the buffers this task sends down."""
        return _nbytes(self.buffers)


@dataclass(frozen=True)
class Update:
    """What one client sends back after a local round.

    buffers:     named result buffers ("params", "momentum", ...); empty when the task did
                 not allow an upload.
    num_samples: the client's sample count |D_i| (the weight of `weighting: samples`).
    train_loss:  mean minibatch loss over the local steps.
    steps:       local steps taken (tau_i; FedNova normalises by it).
    scalars:     further strategy-specific numbers (FedUmf's "fused" flag, FedVeca's
                 estimates, ...).
    """
    buffers: Mapping[str, np.ndarray]
    num_samples: int
    train_loss: float
    steps: int
    scalars: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        fields = self.__dict__          # (a frozen dataclass's own fields, set as __init__ does)
        fields["buffers"] = _frozen_buffers(self.buffers, "update")
        fields["scalars"] = _frozen_mapping(self.scalars)
        fields["num_samples"] = int(self.num_samples)
        fields["steps"] = int(self.steps)
        fields["train_loss"] = float(self.train_loss)

    @property
    def nbytes(self) -> int:
        """float32 bytes of the buffers this update sends up."""
        return _nbytes(self.buffers)


@dataclass(frozen=True)
class Contribution:
    """What one client adds to a round's sum, for the strategies whose server step needs only
    a weighted sum of the clients' updates (`Strategy.secure_sum`): secure aggregation masks
    it, DP clips and noises it, and the server sees only the sum of the round's contributions
    (`SumTotal`), never one of them.

    vector:  flat float32, the client's update as a DELTA from the task's buffers (so a fixed
             quantisation range means the same for every model), before its weight is folded
             in; e.g. FedAvg's w_i - w, FedNova's (w_i - w) / ||a_i||_1, MFL's deltas of w
             and d end to end. DP's client hook clips and noises this vector.
    weight:  the strategy's weight of this client, a non-negative whole number (|D_i| for
             `weighting: samples`, 1 for uniform): the sum is sum_i weight_i * vector_i, and
             secure aggregation folds it in exactly, as an integer product in the ring.
    scalars: named numbers summed as given, weights already folded in where the server step
             needs them (FedNova's weight_i * ||a_i||_1); the round engine adds the two
             the record needs (`rounds.LOSS_SCALARS`).
    """
    vector: np.ndarray
    weight: int
    scalars: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self):
        vec = self.vector
        if not isinstance(vec, np.ndarray) or vec.dtype != _F32 or vec.ndim != 1 \
                or not vec.flags.c_contiguous:
            got = f"{vec.dtype} {vec.shape}" if isinstance(vec, np.ndarray) else type(vec).__name__
            raise StrategyError(f"contribution vector: need a flat contiguous float32 array, "
                                f"got {got}")
        if isinstance(self.weight, bool) or int(self.weight) != self.weight or self.weight < 0:
            raise StrategyError(f"contribution weight {self.weight!r}: need a whole number >= 0 "
                                f"(a sample count, or 1)")
        object.__setattr__(self, "weight", int(self.weight))
        object.__setattr__(self, "scalars", _frozen_mapping(
            {str(k): float(v) for k, v in dict(self.scalars).items()}))


@dataclass(frozen=True)
class SumTotal:
    """The sum of a round's contributions: all the server step of a `secure_sum` strategy
    reads (`Strategy.aggregate_sum`). Secure aggregation hands it over unmasked and
    dequantised, a DP-only round sums in the clear; DP's server hook may add noise to it.

    vector:  float32, sum_i weight_i * vector_i over the contributing clients.
    weight:  sum_i weight_i.
    scalars: {name: sum_i scalar_i}.
    count:   how many clients contributed (the survivors of a secure round).
    """
    vector: np.ndarray
    weight: float
    scalars: Mapping[str, float]
    count: int

    def __post_init__(self):
        object.__setattr__(self, "scalars", _frozen_mapping(self.scalars))
        object.__setattr__(self, "weight", float(self.weight))
        object.__setattr__(self, "count", int(self.count))

    def replace(self, **changes) -> "SumTotal":
        """A new SumTotal with some fields replaced (a DP hook's noisy vector, say)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class State:
    """Server or client state: named flat buffers plus JSON-able metadata. Never mutated;
    a strategy returns a new State. This is exactly what a checkpoint stores."""
    buffers: Mapping[str, np.ndarray]
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "buffers", _frozen_buffers(self.buffers, "state"))
        object.__setattr__(self, "meta", _frozen_mapping(self.meta))

    def replace(self, buffers: Mapping | None = None, **meta) -> "State":
        """A new State with some buffers and/or meta keys replaced."""
        new_buffers = dict(self.buffers)
        new_buffers.update(buffers or {})
        new_meta = dict(self.meta)
        new_meta.update(meta)
        return State(new_buffers, new_meta)


@dataclass(frozen=True)
class LocalData:
    """What a client holds locally: its id, the model architecture (the same on every
    client) and its samples (float32 C-contiguous x, int32 labels or float32 targets y).
    `stop`: None, or the kernels.StopFlag every local round on this data passes to the
    kernel, so a stopping process ends the round within one step (TrainingStopped)."""
    client: int
    model: Any
    x: np.ndarray
    y: np.ndarray
    stop: Any = None

    @property
    def num_samples(self) -> int:
        return int(self.x.shape[0])

    @functools.cached_property
    def samples(self) -> kernels.Samples:
        """x and y checked against the model once, for every local round on this data."""
        return kernels.Samples(self.model, self.x, self.y)

    @classmethod
    def of_samples(cls, client: int, samples: kernels.Samples, y: np.ndarray,
                   stop=None) -> "LocalData":
        """The LocalData of data checked already (`samples`, e.g. a client's rows of a
        training set checked once as a whole, and `y`, the labels or targets they were
        checked from): its local rounds skip the check."""
        if cls is not LocalData:
            data = cls(client, samples.model, samples.x, y, stop)
        else:       # once per client trained, every round: the fields set as __init__ does
            data = object.__new__(cls)
            data.__dict__.update(client=client, model=samples.model, x=samples.x, y=y, stop=stop)
        data.__dict__["samples"] = samples        # what the cached property would compute
        return data


@dataclass(frozen=True)
class PrepareContext:
    """What a strategy's offline phase (`Strategy.prepare`) is given besides the federation.
    The caller (`edgefl simulate`, `edgefl duw-train`) fills it in from its run config, so a
    strategy never reads a config, and writes files only where it is told.

    where:             the config's name, the prefix of error messages ("<config>" if none).
    base_dir:          relative paths in the strategy's parameters (e.g. DUW's `weights`)
                       are looked up here first (the config file's directory), then in the
                       working directory; None: the working directory only.
    clients_per_round: how many clients the run selects per round (None: not known), for
                       strategies that need every client in every round to say so before
                       an expensive offline phase rather than in round 1.
    record:            the run config as plain data, stored with what the phase writes.
    out_dir:           the run's output directory; the phase writes a result it names
                       NAME to out_dir/NAME (None: nowhere) ...
    out_files:         ... unless the caller asked for it at a path of its own:
                       {NAME: path} (`edgefl duw-train --out`).
    stream:            where progress lines go (None: silent).
    workers:           threads the phase may use.
    """
    where: str = "<config>"
    base_dir: str | None = None
    clients_per_round: int | None = None
    record: Mapping | None = None
    out_dir: str | None = None
    out_files: Mapping[str, str] = field(default_factory=dict)
    stream: Any = None
    workers: int = 1

    def output(self, name: str) -> str | None:
        """The path to write the phase's result `name` to, or None to write nothing."""
        if name in self.out_files:
            return str(self.out_files[name])
        return None if self.out_dir is None else os.path.join(os.fspath(self.out_dir), name)

    def resolve(self, path: str) -> str:
        """A path from the strategy's parameters, with ~ expanded; a relative one beside the
        config file when it exists there, else relative to the working directory."""
        path = os.path.expanduser(path)
        if self.base_dir and not os.path.isabs(path):
            beside = os.path.join(self.base_dir, path)
            if os.path.exists(beside):
                return beside
        return path


# a private, writable copy of a flat float32 buffer a strategy was handed (Strategy.init,
# local_round), so nothing is ever written into the caller's array
def _copy(buf: np.ndarray, what: str) -> np.ndarray:
    if type(buf) is np.ndarray and buf.dtype is _F32 and buf.ndim == 1:
        return buf.copy()          # the common case (once per client per round), same result
    if not isinstance(buf, np.ndarray) or buf.dtype != np.float32 or buf.ndim != 1:
        got = f"{buf.dtype} {buf.shape}" if isinstance(buf, np.ndarray) else type(buf).__name__
        raise StrategyError(f"{what}: need a flat float32 buffer, got {got}")
    return np.array(buf, dtype=np.float32, order="C", copy=True)
