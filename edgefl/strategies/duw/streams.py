"""DUW's random streams: the data order of the meta-training's local rounds and the upload
draws c_k^(t) ~ Bernoulli(p_k) of communication heterogeneity.

Every (meta-iteration, round, client) has a stream of its own (the kernels' local_train adds
the epoch), so a simulation gives the same result whatever thread runs a client. The FL run
(iteration None) uses the run's own `client_seed`s for data order and a deployment code for
the upload draws; each meta-iteration draws fresh shuffles and a fresh drop pattern.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

_DROP_STREAM = 0xD809           # upload success draws c_k^(t) ~ Bernoulli(p_k)
_META_STREAM = 0xDE7A           # data order of the meta-training's local rounds
_DEPLOY = 0                     # iteration code of the FL run (meta-iteration m has m + 1)


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
    an int the meta-iteration (each draws a fresh pattern, as the unrolled training of the
    paper does). p = None: all True."""
    if upload_prob is None:
        return {int(c): True for c in clients}
    code = _DEPLOY if iteration is None else int(iteration) + 1
    out = {}
    for c, p in zip(clients, upload_prob):
        rng = np.random.default_rng((int(seed), _DROP_STREAM, code, int(round), int(c)))
        out[int(c)] = bool(rng.random() < p)
    return out
