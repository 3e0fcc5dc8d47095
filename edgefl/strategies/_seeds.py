"""Selection and seeds, shared by every strategy so reductions like FedUmf alpha=0 == FedAvg
hold bit for bit: the same clients are selected and they see their data in the same order.
`client_seed` derives a local round's seed from (run seed, round, client); `select_clients`
picks a round's clients from (run seed, round) alone; `_round_base` is what
`Strategy.local_config` shares between the clients of one round."""
from __future__ import annotations

import functools
import math
import types
from typing import Mapping, Sequence

import numpy as np

from .. import kernels
from ._types import Setup, StrategyError


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


def select_clients(seed: int, round: int, clients: Sequence[int], m: int,
                   draw: int = 0) -> list:
    """m of `clients`, uniformly without replacement, from a Generator seeded by
    (seed, round) alone: a fixed M, uniform without replacement, for every algorithm.
    Stateless, so a resumed run selects the same clients, and independent of the strategy
    and its parameters, so runs of different algorithms with one seed select alike.
    Returned sorted.

    draw: the asynchronous driver tasks idle clients several times per version; draw j > 0
    seeds the j-th of them by (seed, round, j), and draw 0 is the synchronous selection, so
    a first draw of the whole cohort selects as a synchronous round does."""
    if not (isinstance(clients, range) and clients.step == 1):
        clients = sorted(int(c) for c in clients)
    # (a range 0..N-1 is sorted already: a million clients cost m draws, not a sort of N)
    if not 1 <= m <= len(clients):
        raise StrategyError(f"select_clients: cannot select {m} of {len(clients)} clients")
    if m == len(clients):
        return list(clients)
    key = (int(seed), _SELECT_STREAM, int(round)) + ((int(draw),) if draw else ())
    rng = np.random.default_rng(key)
    picked = rng.choice(len(clients), size=m, replace=False).tolist()
    if isinstance(clients, range):        # clients[i] is start + i: no lookup per client
        return sorted([i + clients.start for i in picked] if clients.start else picked)
    return sorted(clients[i] for i in picked)
