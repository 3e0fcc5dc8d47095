"""Attacks for robustness experiments: a seeded set of malicious clients whose uploads are
transformed, configured by the run config's `attack:` section (issue #7 item 4).

    attack: {kind: sign_flip, fraction: 0.2, factor: 4, seed: 0}
    edgefl simulate quickstart --set attack.kind=scale --set attack.factor=-5

It is a wrapper around any strategy's client half (`Attacked`): the server half is the
wrapped strategy's, untouched, so the defence is whatever the strategy does (e.g. its
`robust` option, strategies/robust.py); nothing tells the server who the attackers are.
The wrapper is registered (unlisted) as the strategy "attacked", so a client over MQTT
rebuilds it from the round announcement like any strategy: the same attack runs in
`edgefl simulate` and through a broker, with no change to the roles. Over MQTT the
aggregator's config thus tells its clients to attack; it is an experiment, not a threat
model for a real fleet.

An honest client's update is u = w_i - w (w: the buffer the task started from, for every
uploaded buffer the task also sent: the model, MFL's momentum). A malicious client uploads
w + u' with

    sign_flip   u' = -factor * u                      factor > 0, default 1
    scale       u' =  factor * u                      factor != 0, default 10 (negative:
                                                      a scaled sign flip)
    noise       u' =  factor * ||u|| * g / ||g||,     g ~ N(0, I) seeded by (seed, round,
                                                      client); factor > 0, default 1
    nan         every value NaN (a crashed or corrupt client; no factor)

Its scalars (sample count, loss, steps, FedNova's a_norm) are sent unchanged.

The malicious clients: `clients: [ids]`, or `fraction` (default 0.2) of the federation's
clients, round(fraction * N) of them drawn without replacement by a Generator seeded by
(seed, stream), independent of the run seed, so the same clients attack whatever the
strategy under test.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .strategies import (Strategy, StrategyError, Update, get_strategy, register)

__all__ = ["KINDS", "ATTACK_KEYS", "AttackError", "attack_section", "malicious_clients",
           "with_attack", "Attacked"]

KINDS = ("sign_flip", "scale", "noise", "nan")
ATTACK_KEYS = ("kind", "fraction", "clients", "factor", "seed")
DEFAULT_FACTOR = {"sign_flip": 1.0, "scale": 10.0, "noise": 1.0, "nan": None}
DEFAULT_FRACTION = 0.2
_ATTACK_STREAM = 0xA77AC
_NOISE_STREAM = 0x0015E


class AttackError(ValueError):
    """An `attack:` section the run cannot use; `key` is the offending key (e.g.
    "attack.factor"), the message says why."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


def _number(key: str, value) -> float:
    if isinstance(value, str):          # YAML 1.1 reads 1e3 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            raise AttackError(key, f"must be a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AttackError(key, f"must be a finite number, got {value!r}")
    return float(value)


def attack_section(value, num_clients: int | None = None) -> dict | None:
    """The validated `attack:` section with defaults filled in, or None (no attack).
    num_clients: the federation's size, to check `clients` ids against it."""
    if value is None:
        return None
    if isinstance(value, str):
        value = {"kind": value}
    if not isinstance(value, Mapping):
        raise AttackError("attack", f"must be a mapping of {', '.join(ATTACK_KEYS)}, "
                                    f"got {value!r}")
    for key in value:
        if key not in ATTACK_KEYS:
            raise AttackError(f"attack.{key}", f"unknown key; valid keys: {', '.join(ATTACK_KEYS)}")
    if "kind" not in value:
        raise AttackError("attack.kind", f"missing; valid: {', '.join(KINDS)}")
    kind = value["kind"]
    if kind not in KINDS:
        raise AttackError("attack.kind", f"{kind!r}; valid: {', '.join(KINDS)}")
    out: dict[str, Any] = {"kind": kind}
    if "fraction" in value and "clients" in value:
        raise AttackError("attack.clients", "give attack.fraction or attack.clients, not both")
    if "clients" in value:
        ids = value["clients"]
        if not isinstance(ids, (list, tuple)) or not ids or any(
                isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in ids):
            raise AttackError("attack.clients", f"must be a non-empty list of client ids "
                                                f"(integers >= 0), got {ids!r}")
        if len(set(ids)) != len(ids):
            raise AttackError("attack.clients", f"lists a client twice: {list(ids)}")
        if num_clients is not None and max(ids) >= num_clients:
            raise AttackError("attack.clients", f"client {max(ids)} does not exist: the "
                                                f"partition has clients 0..{num_clients - 1}")
        out["clients"] = sorted(int(c) for c in ids)
    else:
        fraction = _number("attack.fraction", value.get("fraction", DEFAULT_FRACTION))
        if not 0 <= fraction <= 1:
            raise AttackError("attack.fraction", f"{fraction} must be in [0, 1]")
        out["fraction"] = fraction
    if kind == "nan":
        if value.get("factor") is not None:
            raise AttackError("attack.factor", "the nan attack takes no factor")
        out["factor"] = None
    else:
        factor = _number("attack.factor", value.get("factor", DEFAULT_FACTOR[kind]))
        if kind in ("sign_flip", "noise") and not factor > 0:
            raise AttackError("attack.factor", f"{factor} must be > 0 for {kind} (sign_flip "
                                               f"already negates; use kind scale for a "
                                               f"negative factor)")
        if kind == "scale" and factor == 0:
            raise AttackError("attack.factor", "0 would upload no update at all; use a "
                                               "non-zero factor")
        out["factor"] = factor
    seed = value.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise AttackError("attack.seed", f"must be an integer >= 0, got {seed!r}")
    out["seed"] = int(seed)
    return out


def malicious_clients(section: Mapping, clients: Sequence[int]) -> tuple:
    """The sorted ids of the malicious clients among `clients` (every client id of the run)."""
    clients = sorted(int(c) for c in clients)
    if "clients" in section:
        unknown = sorted(set(section["clients"]) - set(clients))
        if unknown:
            raise AttackError("attack.clients", f"client(s) {unknown} are not in the run "
                                                f"(clients {clients[0]}..{clients[-1]})")
        return tuple(section["clients"])
    m = int(math.floor(section["fraction"] * len(clients) + 0.5))
    rng = np.random.default_rng((int(section["seed"]), _ATTACK_STREAM))
    picked = rng.choice(len(clients), size=m, replace=False)
    return tuple(sorted(clients[i] for i in picked))


def with_attack(strategy: Strategy, section: Mapping, clients: Sequence[int]) -> "Attacked":
    """`strategy` with the attack `section` (validated by `attack_section`) on the malicious
    ones of `clients`."""
    if isinstance(strategy, Attacked):
        raise StrategyError(f"the strategy is already attacked ({strategy.kind} by clients "
                            f"{list(strategy.clients)})")
    attacked = Attacked(strategy=strategy.name, params=strategy.hyperparameters(),
                        kind=section["kind"], factor=section["factor"],
                        clients=malicious_clients(section, clients), seed=section["seed"],
                        _inner=strategy)
    return attacked


@register("attacked")
@dataclass(frozen=True)
class Attacked(Strategy):
    """`strategy` (a registered name) built with `params`, whose clients in `clients`
    transform their uploads by `kind` and `factor` (module docstring)."""
    listed = False

    strategy: str = "fedavg"
    params: dict | None = None
    kind: str = "sign_flip"
    factor: float | None = 1.0
    clients: tuple = ()
    seed: int = 0
    # the wrapped instance, when the caller has it already (e.g. after DUW's offline
    # phase); otherwise built from (strategy, params). Not a hyper-parameter.
    _inner: Strategy | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.strategy == self.name:
            raise StrategyError("attacked: cannot wrap an attacked strategy")
        section = {"kind": self.kind, "clients": list(self.clients) or [0], "seed": self.seed}
        if self.factor is not None:
            section["factor"] = self.factor
        try:
            checked = attack_section(section)
        except AttackError as exc:
            raise StrategyError(f"strategy 'attacked': {exc.key.replace('attack.', '')} = "
                                f"{exc.problem}") from None
        object.__setattr__(self, "factor", checked["factor"])
        object.__setattr__(self, "clients", tuple(sorted(int(c) for c in self.clients)))
        object.__setattr__(self, "params", dict(self.params or {}))
        if self._inner is None:
            object.__setattr__(self, "_inner", get_strategy(self.strategy, **self.params))

    @property
    def inner(self) -> Strategy:
        """The wrapped strategy."""
        return self._inner

    def hyperparameters(self) -> dict:
        params = super().hyperparameters()
        params.pop("_inner")
        params["clients"] = list(self.clients)
        return params

    # ---------------------------------------------------------------- server half: the inner's
    def init(self, global_params, cfg):
        return self._inner.init(global_params, cfg)

    def configure(self, round, clients, state):
        return self._inner.configure(round, clients, state)

    def aggregate(self, round, updates, state):
        return self._inner.aggregate(round, updates, state)

    def global_model(self, state):
        return self._inner.global_model(state)

    def evaluated_members(self, state):
        return self._inner.evaluated_members(state)

    # What the wrapped strategy is, where the Strategy base defines a default that
    # __getattr__ would never reach: an attacked FedBuff ran as synchronous rounds, and an
    # attacked FedMR's evaluate_models scored nothing, silently.
    @property
    def asynchronous(self) -> bool:
        return self._inner.asynchronous

    def __getattr__(self, name):
        # strategy-specific helpers of the wrapped strategy (not dunders, not during init)
        if name.startswith("__") or name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    # ---------------------------------------------------------------- client half: attacked
    def train(self, task, local_data, client_state):
        update, new_state = self._inner.train(task, local_data, client_state)
        if int(local_data.client) not in self.clients or not update.buffers:
            return update, new_state
        buffers = {name: self._transform(buf, task.buffers.get(name), task.round,
                                         int(local_data.client), i)
                   for i, (name, buf) in enumerate(sorted(update.buffers.items()))}
        return Update(buffers, update.num_samples, update.train_loss, update.steps,
                      update.scalars), new_state

    def _transform(self, buf: np.ndarray, start: np.ndarray | None, round: int, client: int,
                   index: int) -> np.ndarray:
        if self.kind == "nan":
            return np.full_like(buf, np.nan)
        if start is None or start.size != buf.size:     # no reference to measure from
            return np.array(buf, dtype=np.float32)
        start64 = start.astype(np.float64)
        u = buf.astype(np.float64) - start64
        if self.kind == "sign_flip":
            u *= -self.factor
        elif self.kind == "scale":
            u *= self.factor
        else:   # noise
            rng = np.random.default_rng((self.seed, _NOISE_STREAM, round, client, index))
            g = rng.standard_normal(u.size)
            norm_g = float(np.linalg.norm(g))
            u = g * (self.factor * float(np.linalg.norm(u)) / norm_g) if norm_g else g
        with np.errstate(over="ignore"):                  # a huge factor may overflow: the point
            return (start64 + u).astype(np.float32)
