"""Federated-learning algorithms as strategies: a server half and a client half, pure, no I/O
(docs/algorithms.md says what each one computes; docs/architecture.md how one plugs in).

    strategy = get_strategy("mfl", gamma=0.5)
    state = strategy.init(w0, Setup(clients=range(10), train={"lr": 0.05}))
    tasks = strategy.configure(1, [2, 5, 7], state)                 # {client: Task}
    update, cstate = strategy.train(tasks[2], local_data[2], None)  # on the client
    state, metrics = strategy.aggregate(1, {2: u2, 5: u5, 7: u7}, state)
    w = strategy.global_model(state)

Rules every strategy follows:

- **Pure.** No I/O, no clocks, no global RNG. Randomness comes from the seeds in `Task.train`
  (derived from (run seed, round, client) by `Strategy.local_config`), so a client's local
  round is the same whichever thread or board runs it.
- **Copy-on-write.** `State`, `Task` and `Update` hand their buffers over: the constructors
  make them read-only, so a strategy that writes into a buffer it received fails loudly
  instead of corrupting the caller's model. New buffers are new arrays.
- **State is returned**, never mutated: `aggregate` returns a new `State`; `train` returns the
  client's new state. A `State` is what a checkpoint saves (buffers + JSON-able meta).
- **Fixed order.** Aggregation visits clients in sorted id order with float64 accumulation
  (`weighted_average`), so the result does not depend on the order updates arrived in.

Round numbers start at 1 (round t = 1..T); papers that count from 0 are translated.
The global model is `state.buffers["params"]` unless a strategy overrides `global_model`.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import os
import pkgutil
import types
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar, Iterable, Mapping, Sequence

import numpy as np

from .. import kernels

__all__ = ["StrategyError", "Setup", "Task", "Update", "State", "LocalData", "PrepareContext",
           "Strategy", "register", "get_strategy", "strategy_names", "strategy_params",
           "client_seed", "select_clients", "exact_weights", "aggregation_weights",
           "weighted_average", "average_updates", "mean_train_loss", "local_round",
           "check_choice", "check_number", "WEIGHTINGS", "extension_field"]

WEIGHTINGS = ("samples", "uniform")


class StrategyError(ValueError):
    """A strategy name, parameter or input the strategy cannot use; the message names it."""


# ---------------------------------------------------------------------------------------
# read-only containers
# ---------------------------------------------------------------------------------------

_F32 = np.dtype(np.float32)


def _frozen_buffers(buffers: Mapping[str, np.ndarray], what: str) -> Mapping[str, np.ndarray]:
    # every Task, Update and State goes through here: a few us each add up in a round of
    # many clients (issue #3's overhead target), hence one flags object per buffer and the
    # identity test on the dtype before the (slower) equality
    out = {}
    items = buffers.items() if isinstance(buffers, Mapping) else dict(buffers).items()
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


def _frozen_mapping(mapping) -> Mapping:
    return types.MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class Setup:
    """What the server half knows about a run when it starts (the `cfg` of `init`).

    clients:  every client id of the federation (FedUmf trains all of them, not only the
              selected ones).
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
        clients = tuple(int(c) for c in self.clients)
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
        object.__setattr__(self, "clients", tuple(sorted(clients)))
        object.__setattr__(self, "train", _frozen_mapping(train))
        object.__setattr__(self, "lr_decay", float(self.lr_decay))
        object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "rounds", int(self.rounds))
        object.__setattr__(self, "units", tuple(tuple((int(o), int(n)) for o, n in unit)
                                                for unit in self.units))

    def to_json(self) -> dict:
        return {"clients": list(self.clients), "train": dict(self.train),
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
        object.__setattr__(self, "buffers", _frozen_buffers(self.buffers, "task"))
        object.__setattr__(self, "train", _frozen_mapping(self.train))
        object.__setattr__(self, "scalars", _frozen_mapping(self.scalars))

    @property
    def nbytes(self) -> int:
        """float32 bytes of the buffers this task sends down."""
        return sum(b.nbytes for b in self.buffers.values())


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
        object.__setattr__(self, "buffers", _frozen_buffers(self.buffers, "update"))
        object.__setattr__(self, "scalars", _frozen_mapping(self.scalars))
        object.__setattr__(self, "num_samples", int(self.num_samples))
        object.__setattr__(self, "steps", int(self.steps))
        object.__setattr__(self, "train_loss", float(self.train_loss))

    @property
    def nbytes(self) -> int:
        """float32 bytes of the buffers this update sends up."""
        return sum(b.nbytes for b in self.buffers.values())


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
    client) and its samples (float32 C-contiguous x, int32 labels or float32 targets y)."""
    client: int
    model: Any
    x: np.ndarray
    y: np.ndarray

    @property
    def num_samples(self) -> int:
        return int(self.x.shape[0])

    @functools.cached_property
    def samples(self) -> kernels.Samples:
        """x and y checked against the model once, for every local round on this data."""
        return kernels.Samples(self.model, self.x, self.y)


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


# ---------------------------------------------------------------------------------------
# the interface
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Strategy:
    """Base class. Subclasses are frozen dataclasses whose fields are the algorithm's
    hyper-parameters (named as in its spec), validated in `__post_init__`; they register
    with `@register("name")`.

    Server half: `init`, `configure`, `aggregate`. Client half: `train`. The defaults here
    are FedAvg's (broadcast "params", train locally, upload "params"); algorithms override
    what differs.
    """
    name: ClassVar[str] = ""
    listed: ClassVar[bool] = True    # False: a wrapper, not offered by strategy_names()

    # ---------------------------------------------------------------- offline phase
    def prepare(self, init_params: np.ndarray, clients: Mapping[int, "LocalData"],
                setup: Setup, context: PrepareContext | None = None) -> "Strategy":
        """The strategy ready for round 1, after its offline phase, if it has one: work done
        once before the run on the initial model and the clients' data (DUW learns its
        weight table here). Called by the simulator for every strategy, and by
        `edgefl duw-train`. Returns a strategy (itself, or a copy holding what the phase
        produced in its parameters, so a checkpoint of the run keeps it). The default: no
        offline phase."""
        return self

    # ---------------------------------------------------------------- server half
    def init(self, global_params: np.ndarray, cfg: Setup) -> State:
        """The server state before round 1: a copy of the initial model and the setup."""
        return State({"params": _copy(global_params, "global_params")},
                     {"round": 0, "setup": cfg.to_json()})

    def configure(self, round: int, clients: Sequence[int], state: State) -> dict:
        """{client: Task} for round `round`; `clients` are the selected clients."""
        setup = self.setup(state)
        shared = {"params": state.buffers["params"]}
        return {c: Task(round, shared, self.local_config(setup, round, c)) for c in sorted(clients)}

    def aggregate(self, round: int, updates: Mapping[int, Update], state: State):
        """(new state, metrics) from the uploads of round `round`."""
        raise NotImplementedError

    def global_model(self, state: State) -> np.ndarray:
        """The model to evaluate, export and checkpoint."""
        return state.buffers["params"]

    # ---------------------------------------------------------------- client half
    def train(self, task: Task, local_data: LocalData, client_state: State | None):
        """(Update, new client state) for one local round. `client_state` is None the first
        time a client trains."""
        raise NotImplementedError

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def setup(state: State) -> Setup:
        return _setup_of(state.meta["setup"])

    @staticmethod
    def local_config(setup: Setup, round: int, client: int, **overrides) -> dict:
        """The `kernels.train_config` of `client`'s local round `round`: the setup's train
        section, the round's lr (eta_t = lr * lr_decay**(t-1)), the data-order seed from
        (seed, round, client), then per-client `overrides` (e.g. steps)."""
        base, prefix = _round_base(setup, round)
        cfg = dict(base)
        cfg["seed"] = _seed_of(prefix, client)
        if overrides:
            cfg.update(overrides)
            return kernels.train_config(**cfg)
        return cfg

    def hyperparameters(self) -> dict:
        """The hyper-parameters this instance was built with (extension fields only when
        set: `extension_field`)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if not (f.metadata.get("extension") and getattr(self, f.name) == f.default)}


_SETUP_CACHE: dict = {}     # id(setup JSON) -> (that JSON, its Setup)
_SETUP_CACHE_SIZE = 16


def _setup_of(data: Mapping) -> Setup:
    """Setup.from_json(data), parsed once per JSON object: `State.replace` hands the same
    "setup" object from round to round, and re-validating it in every configure and
    aggregate was a tenth of a digits round's overhead. The cache holds the JSON object
    itself, so an id is never reused while its entry lives; the JSON is read-only by the
    State convention (a checkpoint stores it as is)."""
    hit = _SETUP_CACHE.get(id(data))
    if hit is not None and hit[0] is data:
        return hit[1]
    setup = Setup.from_json(data)
    if len(_SETUP_CACHE) >= _SETUP_CACHE_SIZE:
        _SETUP_CACHE.clear()         # atomic, unlike evicting one entry while threads insert
    _SETUP_CACHE[id(data)] = (data, setup)
    return setup


def extension_field(default=None):
    """A strategy parameter that extends the published algorithm (e.g. `robust`,
    strategies/robust.py). Left at its default it changes nothing, is not listed by
    `strategy_params` (unless asked) and not returned by `hyperparameters()`, so configs,
    checkpoints and announcements of plain runs stay exactly as they were."""
    return field(default=default, metadata={"extension": True})


# ---------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------

_REGISTRY: dict[str, type] = {}
# strategies that wrap another one and are not chosen by name in a config (an attack is the
# run config's `attack:` section), but a client must rebuild them from an announcement
_WRAPPER_MODULES = ("edgefl.attacks",)
_DISCOVERED = False


def _load_builtin() -> None:
    """Import every algorithm of this package once, so its `@register` has run.

    The rule: every module and subpackage of edgefl.strategies is an algorithm, except
    - names starting with "_" (Python's mark of a private module), and
    - modules that say `HELPER = True` at module level: shared code the algorithms import
      (robust.py). They are imported too (that is harmless) but need not register.
    So adding an algorithm is dropping one file (or package) here; there is no list to keep.
    A module that is neither a helper nor registers a strategy is an error, not silence: a
    forgotten `@register` would otherwise surface later as "unknown strategy". The helper
    mark is a flag, not a leading underscore, because helpers such as `robust` are public
    API that tests and other modules import by name.
    """
    global _DISCOVERED
    if _DISCOVERED:
        return
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if getattr(module, "HELPER", False):
            continue
        if not any(cls.__module__ == module.__name__
                   or cls.__module__.startswith(module.__name__ + ".")
                   for cls in _REGISTRY.values()):
            raise StrategyError(f"{module.__name__} registers no strategy: decorate its "
                                f"Strategy class with @register(name), or mark the module "
                                f"HELPER = True if it only holds shared code")
    for module in _WRAPPER_MODULES:
        importlib.import_module(module)
    _DISCOVERED = True      # set last: a failed import is retried (and raises) next time


def register(name: str):
    """Class decorator: make a Strategy subclass available as get_strategy(name)."""
    def wrap(cls):
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise TypeError(f"register({name!r}): {cls!r} is not a Strategy subclass")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise StrategyError(f"strategy {name!r} is registered twice "
                                f"({_REGISTRY[name].__module__} and {cls.__module__})")
        if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:
            raise TypeError(f"register({name!r}): {cls.__name__} must be a frozen dataclass")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return wrap


def strategy_names() -> list:
    """The algorithms a config may name (not the wrappers: `Strategy.listed`)."""
    _load_builtin()
    return sorted(name for name, cls in _REGISTRY.items() if cls.listed)


def strategy_params(name: str, *, extensions: bool = False) -> dict:
    """{parameter: default} of strategy `name`; with extensions=True also its extension
    fields (`extension_field`, e.g. `robust`)."""
    cls = _lookup(name)
    return {f.name: f.default for f in dataclasses.fields(cls)
            if extensions or not f.metadata.get("extension")}


def get_strategy(name: str, **params) -> Strategy:
    """The strategy `name` with its hyper-parameters. An unknown name or parameter raises
    StrategyError listing the valid ones; a bad value raises naming the parameter."""
    cls = _lookup(name)
    valid = [f.name for f in dataclasses.fields(cls)]
    for key in params:
        if key not in valid:
            raise StrategyError(f"strategy {name!r}: unknown parameter {key!r}; valid: "
                                f"{', '.join(valid) or '(none)'}")
    return cls(**params)


def _lookup(name: str) -> type:
    _load_builtin()
    if name not in _REGISTRY:
        raise StrategyError(f"unknown strategy {name!r}; valid: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


# ---------------------------------------------------------------------------------------
# parameter checks shared by the algorithm modules
# ---------------------------------------------------------------------------------------

def check_choice(strategy: str, key: str, value, choices: Iterable) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise StrategyError(f"strategy {strategy!r}: {key} = {value!r}; "
                            f"valid: {', '.join(choices)}")


def check_number(strategy: str, key: str, value, lo: float, hi: float, *,
                 lo_open: bool = False, hi_open: bool = False, why: str = "") -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise StrategyError(f"strategy {strategy!r}: {key} = {value!r} must be a number in "
                            f"{interval}" + (f" ({why})" if why else ""))


# ---------------------------------------------------------------------------------------
# selection and seeds (shared by every strategy, so reductions like FedUmf alpha=0 == FedAvg
# hold bit for bit: same selection, same data order)
# ---------------------------------------------------------------------------------------

_SELECT_STREAM = 0x5E1EC7   # separates the selection stream from the per-client train seeds
_TRAIN_STREAM = 0x7EA1


_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """splitmix64's finaliser (Steele, Lea, Flood 2014): a bijection on 64-bit words whose
    output bits each depend on every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def client_seed(seed: int, round: int, client: int) -> int:
    """The seed of `client`'s local round `round`: a 64-bit hash of (seed, round, client),
    independent of thread scheduling, strategy and strategy parameters.

    A chain of splitmix64 finalisers over the words (seed, stream, round, client), in plain
    integer arithmetic: ~2 us where numpy's SeedSequence took ~14 us, and the aggregator
    derives one per selected client per round on its critical path (issue #3's simulation
    overhead target); `local_config` hashes (seed, stream, round) once per round."""
    return _seed_of(_seed_prefix(seed, round), client)


def _seed_prefix(seed: int, round: int) -> int:
    """client_seed's chain over (seed, stream, round): the same for a round's clients."""
    h = _mix64((int(seed) + _GOLDEN64) & _MASK64)
    for word in (_TRAIN_STREAM, int(round)):
        h = _mix64(((h ^ (word & _MASK64)) + _GOLDEN64) & _MASK64)
    return h


def _seed_of(prefix: int, client: int) -> int:
    return _mix64(((prefix ^ (int(client) & _MASK64)) + _GOLDEN64) & _MASK64)


class _RoundBase:
    """The last (setup, round) `local_config` was asked for, and what every client of that
    round shares: the validated train section with the round's lr, and the seed prefix.
    configure() asks for a round's clients one after another, so one entry serves all but
    the first; the entry is replaced as one tuple, which is safe across threads."""
    entry: tuple = (None, None, None)


def _round_base(setup: Setup, round: int) -> tuple:
    s, r, value = _RoundBase.entry
    if s is setup and r == round:
        return value
    cfg = dict(_validated_train(setup.train))
    cfg["lr"] = setup.lr(round)
    if not math.isfinite(cfg["lr"]) or cfg["lr"] < 0:        # lr_decay ** t overflowed
        kernels.train_config(**cfg)                            # (raises, naming lr)
    value = (types.MappingProxyType(cfg), _seed_prefix(setup.seed, round))
    _RoundBase.entry = (setup, round, value)
    return value


@functools.lru_cache(maxsize=64)
def _validated_train_items(items: tuple) -> Mapping:
    return types.MappingProxyType(kernels.train_config(**dict(items)))


def _validated_train(train: Mapping) -> Mapping:
    """kernels.train_config(**train), validated once per distinct train section (a run has
    one; the hot path only sets lr and seed on a copy)."""
    try:
        return _validated_train_items(tuple(sorted(train.items())))
    except TypeError:                     # an unhashable value: validate every time
        return kernels.train_config(**train)


def select_clients(seed: int, round: int, clients: Sequence[int], m: int) -> list:
    """m of `clients`, uniformly without replacement, from a Generator seeded by
    (seed, round) alone: a fixed M, uniform without replacement, for every algorithm.
    Stateless, so a resumed run selects the same clients, and independent of the strategy
    and its parameters, so runs of different algorithms with one seed select alike.
    Returned sorted."""
    clients = sorted(int(c) for c in clients)
    if not 1 <= m <= len(clients):
        raise StrategyError(f"select_clients: cannot select {m} of {len(clients)} clients")
    if m == len(clients):
        return clients
    rng = np.random.default_rng((int(seed), _SELECT_STREAM, int(round)))
    picked = rng.choice(len(clients), size=m, replace=False)
    return sorted(clients[i] for i in picked)


# ---------------------------------------------------------------------------------------
# aggregation math (free functions over flat buffers)
# ---------------------------------------------------------------------------------------

def _weight_parts(updates: Mapping[int, Update], weighting: str):
    """(sorted client ids, numerators, denominator) of the aggregation weights."""
    clients = sorted(updates)
    if not clients:
        raise StrategyError("aggregate: no updates to aggregate")
    if weighting == "uniform":
        return clients, [1] * len(clients), len(clients)
    if weighting != "samples":
        raise StrategyError(f"weighting {weighting!r}; valid: {', '.join(WEIGHTINGS)}")
    counts = [updates[c].num_samples for c in clients]
    total = sum(counts)
    if total <= 0 or min(counts) < 0:
        raise StrategyError(f"aggregate: sample counts {counts} cannot weight an average")
    return clients, counts, total


def exact_weights(updates: Mapping[int, Update], weighting: str = "samples"):
    """(sorted client ids, exact rational weights summing to exactly 1).

    samples: p_i = |D_i| / sum_j |D_j| (FedAvg, McMahan et al. 2017; MFL (8)-(9)).
    uniform: p_i = 1 / K (FedUmf's plain average of the authorised clients).
    """
    clients, nums, den = _weight_parts(updates, weighting)
    return clients, [Fraction(n, den) for n in nums]


def aggregation_weights(updates: Mapping[int, Update], weighting: str = "samples"):
    """(sorted client ids, float64 weights) of `exact_weights`. Each weight is the correctly
    rounded value of the exact ratio, so strategies that agree mathematically on the weights
    (FedNova with equal tau, MFL with gamma = 0, FedUmf with alpha = 0) agree bit for bit.
    (CPython's int / int is correctly rounded: the same float as float(Fraction(n, d)),
    without building the Fraction.)"""
    clients, nums, den = _weight_parts(updates, weighting)
    return clients, np.array([n / den for n in nums])


def weighted_average(buffers: Sequence[np.ndarray], weights) -> np.ndarray:
    """A new buffer sum_k weights[k] * buffers[k]: one streaming pass over K separate
    buffers, float64 accumulation in k order, one rounding to float32 (kernels.weighted_sum)."""
    buffers = list(buffers)
    if not buffers:
        raise StrategyError("weighted_average: no buffers")
    out = np.empty_like(buffers[0])
    kernels.weighted_sum(out, buffers, weights)
    return out


def average_updates(updates: Mapping[int, Update], name: str, clients: Sequence[int],
                    weights) -> np.ndarray:
    """weighted_average of buffer `name` over `clients` (in that order)."""
    missing = [c for c in clients if name not in updates[c].buffers]
    if missing:
        raise StrategyError(f"aggregate: update of client(s) {missing} has no {name!r} buffer "
                            f"(got {sorted(updates[missing[0]].buffers)})")
    return weighted_average([updates[c].buffers[name] for c in clients], weights)


def mean_train_loss(updates: Mapping[int, Update]) -> float:
    """Mean minibatch loss over all local steps of the uploaded updates
    (for FedUmf, over the authorised clients' steps only: the others upload nothing)."""
    steps = sum(u.steps for u in updates.values())
    if not steps:
        return float("nan")
    return sum(u.train_loss * u.steps for _, u in sorted(updates.items())) / steps


# ---------------------------------------------------------------------------------------
# the client's local round
# ---------------------------------------------------------------------------------------

def local_round(data: LocalData, start: np.ndarray, cfg: Mapping,
                momentum: np.ndarray | None = None):
    """Train from a private copy of `start` for one local round (one C call); returns
    (params, momentum, result). A momentum buffer is copied from `momentum` if given
    (MFL carries it), else a fresh zero buffer is used when cfg momentum > 0 (FedAvg-style
    local momentum, reset every round: a buffer is never carried over or sent)."""
    params = _copy(start, "task params")
    mom = None
    if momentum is not None:
        mom = _copy(momentum, "task momentum")
    elif cfg["momentum"] > 0:
        mom = np.zeros_like(params)
    # `start` (read only) is the centre of FedProx's proximal term when cfg prox_mu > 0; with
    # prox_mu = 0 the kernel skips the term and never reads it
    result = kernels.train_samples(data.samples, params, cfg, momentum=mom, anchor=start)
    return params, mom, result


def _copy(buf: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(buf, np.ndarray) or buf.dtype != np.float32 or buf.ndim != 1:
        got = f"{buf.dtype} {buf.shape}" if isinstance(buf, np.ndarray) else type(buf).__name__
        raise StrategyError(f"{what}: need a flat float32 buffer, got {got}")
    return np.array(buf, dtype=np.float32, order="C", copy=True)
