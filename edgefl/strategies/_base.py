"""The Strategy base class every algorithm subclasses (its defaults are FedAvg's), and
`extension_field` for parameters that extend a published algorithm."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, Mapping, Sequence

import numpy as np

from .. import kernels
from ._seeds import _round_base, _seed_of
from ._types import (Contribution, LocalData, PrepareContext, Setup, State, StrategyError,
                     SumTotal, Task, Update, _copy)


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
    # True: `edgefl simulate` runs it with the asynchronous driver (edgefl/sim/asynchronous.py:
    # clients train at once and a buffer closes each step), e.g. FedBuff
    asynchronous: ClassVar[bool] = False
    # Whether the server step needs only the weighted sum of the clients' updates, so it can
    # run on what secure aggregation or DP hand it (edgefl.privacy); when not, the reason.
    secure_sum: ClassVar[bool] = False
    secure_sum_refusal: ClassVar[str] = ""

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
        return Task.shared(round, {"params": state.buffers["params"]},
                           self.local_configs(self.setup(state), round, clients))

    def aggregate(self, round: int, updates: Mapping[int, Update], state: State):
        """(new state, metrics) from the uploads of round `round`."""
        raise NotImplementedError

    def aggregate_sum(self, round: int, total: SumTotal, state: State):
        """(new state, metrics) of round `round` from the sum of its contributions alone
        (`contribution`, summed by the round engine in the clear or by secure aggregation):
        the same server step as `aggregate`, equal to it up to float32 rounding. Only for
        strategies with `secure_sum`."""
        raise StrategyError(f"{self.name}: its server step needs each client's update, not "
                            f"only their sum (secure_sum is False)")

    def global_model(self, state: State) -> np.ndarray:
        """The model to evaluate, export and checkpoint."""
        return state.buffers["params"]

    def evaluated_members(self, state: State):
        """Models besides the global one that a round's evaluation also scores (their test
        accuracies go into the record as member_accuracy), as a sequence of flat parameter
        buffers, or None (the default: only the global model is evaluated)."""
        return None

    # ---------------------------------------------------------------- client half
    def train(self, task: Task, local_data: LocalData, client_state: State | None):
        """(Update, new client state) for one local round. `client_state` is None the first
        time a client trains."""
        raise NotImplementedError

    def contribution(self, task: Task, update: Update) -> Contribution:
        """What this client adds to the round's sum (`Contribution`): its update as a delta
        from `task`'s buffers, its weight and scalars. Only for strategies with `secure_sum`;
        the server side is `aggregate_sum`."""
        raise StrategyError(f"{self.name}: its server step needs each client's update, not "
                            f"only their sum (secure_sum is False)")

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

    @staticmethod
    def local_configs(setup: Setup, round: int, clients, **overrides) -> dict:
        """{client: local_config(setup, round, client, **overrides)} for `clients`, in sorted
        order: the round's shared part made (and, with overrides, validated) once, then one
        dict per client that differs only in its seed (valid by construction). The same
        dicts as a local_config call per client, for a round of many clients."""
        base, prefix = _round_base(setup, round)
        if overrides:
            base = dict(base)
            base.update(overrides)
            base = kernels.train_config(**base)
        configs = {}
        for c in sorted(clients):
            cfg = dict(base)
            cfg["seed"] = _seed_of(prefix, c)
            configs[c] = cfg
        return configs

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
