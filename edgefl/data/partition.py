"""Partitioners: pure functions of the training labels and a seeded Generator that split a
training set among clients (docs/data.md; FedLab's convention).

Each has the signature `f(labels, n_clients, rng, **options) -> Partition`. Every partition
is complete and disjoint (each training index goes to exactly one client), every client gets
at least one sample, and the same Generator state gives the same split.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .datasets import check_real


@dataclass(frozen=True)
class Partition:
    """Per-client sorted int64 index arrays into the training set, pairwise disjoint.

    `labels` is None, or one label array per client (aligned with `indices`) that replaces
    y_train[indices] for that client (label-noise).

    `indices` is a tuple, or a `Shards` (each client's indices a slice of one array: the
    layout `edgefl simulate` trains from, and the only one that stays small with a million
    clients); with `tile` (data.partition's option) clients share shards, and `indices` and
    `labels` are `Tiled` sequences over the shards.
    """
    indices: tuple
    labels: tuple | None = None

    @property
    def sizes(self) -> np.ndarray:
        indices = self.indices
        if isinstance(indices, (Shards, Tiled)):
            return indices.sizes
        return np.array([len(i) for i in indices], dtype=np.int64)


class Shards(Sequence):
    """Per-client index arrays as offsets into one array: client i's indices are
    order[offsets[i]:offsets[i + 1]] (a view). Two int64 arrays whatever the number of
    clients, where a tuple holds one array object per client. (A label-noise split's
    per-client labels are laid out the same way: `order` is then the labels.)"""

    def __init__(self, order: np.ndarray, offsets: np.ndarray):
        order = np.asarray(order)
        if order.ndim != 1:
            raise ValueError(f"Shards: order must be 1-D, got shape {order.shape}")
        offsets = np.asarray(offsets, dtype=np.int64)
        if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 \
                or offsets[-1] != len(order) or np.any(np.diff(offsets) < 0):
            raise ValueError(f"Shards: offsets must rise from 0 to len(order) = {len(order)}")
        self.order, self.offsets = order, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        n = len(self)
        i = _client_index(i, n)
        return self.order[self.offsets[i]:self.offsets[i + 1]]

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)


class Tiled(Sequence):
    """`clients` entries over the shorter sequence `base`: entry c is base[c % len(base)]
    (the clients of a tiled partition share shards)."""

    def __init__(self, base: Sequence, clients: int):
        if len(base) < 1 or clients % len(base):
            raise ValueError(f"Tiled: {clients} clients are not a multiple of {len(base)} shards")
        self.base, self.clients = base, int(clients)

    def __len__(self) -> int:
        return self.clients

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        return self.base[_client_index(i, self.clients) % len(self.base)]

    @property
    def tile(self) -> int:
        return self.clients // len(self.base)

    @property
    def sizes(self) -> np.ndarray:
        base = self.base.sizes if isinstance(self.base, Shards) else \
            np.array([len(i) for i in self.base], dtype=np.int64)
        return np.tile(base, self.tile)


def _client_index(i, n: int) -> int:
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
        raise TypeError(f"client index {i!r} is not an integer")
    i = int(i)
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"client {i} is outside 0..{n - 1}")
    return i


def tile(split: Partition, clients: int) -> Partition:
    """`split`'s shards shared by `clients` clients: client c holds shard c mod len(split)
    (the training set used `clients / len(split)` times over, without a copy)."""
    if clients == len(split.indices):
        return split
    return Partition(Tiled(split.indices, clients),
                     None if split.labels is None else Tiled(split.labels, clients))


def iid(labels: np.ndarray, n_clients: int, rng: np.random.Generator) -> Partition:
    """Shuffle, then equal shares (sizes differ by at most one): the IID setting of the FedUmf
    paper (§5.1.1), MFL's Case 1 (§7.2.2) and FedMR's IID split (its authors' `cifar_iid`)."""
    _check_clients("iid", len(labels), n_clients)
    return _finish("iid", np.array_split(rng.permutation(len(labels)), n_clients))


def shards(labels: np.ndarray, n_clients: int, rng: np.random.Generator, *,
           classes_per_client: int = 2) -> Partition:
    """Pathological label shards, as in FedAvg (the FedUmf paper's non-IID setting, §5.1.1,
    "at most two classes"): sort by label, cut into k*N shards, give each client k shards at
    random without replacement.

    Shards are cut inside class blocks (each class gets a number of shards proportional to its
    size, at least one), so a shard holds one class and a client at most k classes; FedAvg's
    equal cuts across class boundaries would allow up to 2k.
    """
    labels = _class_labels("shards", labels)
    k = _positive_int("shards", "classes_per_client", classes_per_client)
    _check_clients("shards", len(labels), n_clients)
    classes, counts = np.unique(labels, return_counts=True)
    n_shards = k * n_clients
    if n_shards < len(classes):
        raise ValueError(f"shards: classes_per_client x clients = {k} x {n_clients} = {n_shards} "
                         f"shards cannot cover {len(classes)} classes with one class per shard; "
                         f"raise classes_per_client or the number of clients")
    if n_shards > len(labels):
        raise ValueError(f"shards: {n_shards} shards ({k} per client x {n_clients} clients) but "
                         f"only {len(labels)} training samples")
    per_class = _apportion(n_shards, counts, lower=1, upper=counts)
    order = np.argsort(labels, kind="stable")
    blocks = np.split(order, np.cumsum(counts)[:-1])
    all_shards = [s for block, m in zip(blocks, per_class) for s in np.array_split(block, m)]
    owner_of = rng.permutation(n_shards)   # shard owner_of[j] goes to client j // k
    return _finish("shards", [np.concatenate([all_shards[s] for s in owner_of[i * k:(i + 1) * k]])
                              for i in range(n_clients)])


def dirichlet(labels: np.ndarray, n_clients: int, rng: np.random.Generator, *,
              alpha: float = 0.5, min_size: int = 10, max_draws: int = 1000) -> Partition:
    """Dirichlet label skew, as in FedMR's §5.1 (its authors' `separate_data`, after Hsu et al.
    2019).

    For each class: shuffle its indices, draw p ~ Dir(alpha * 1_N), zero p_j for every client
    already holding >= n/N samples, renormalise, split the class at cumsum(p) * n_c. Redraw
    the whole split until the smallest client holds >= min_size samples (at most max_draws
    times). Smaller alpha gives more skew. If every client with room got p_j = 0 (tiny alpha),
    the class is spread uniformly over the clients with room instead of dividing by zero.
    """
    labels = _class_labels("dirichlet", labels)
    if not check_real("dirichlet", "alpha", alpha) > 0:
        raise ValueError(f"dirichlet: alpha must be > 0, got {alpha!r}")
    min_size = _positive_int("dirichlet", "min_size", min_size)
    max_draws = _positive_int("dirichlet", "max_draws", max_draws)
    n = len(labels)
    _check_clients("dirichlet", n, n_clients)
    if min_size * n_clients > n:
        raise ValueError(f"dirichlet: min_size={min_size} for {n_clients} clients needs "
                         f"{min_size * n_clients} samples, but there are {n}; lower min_size")
    members = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    cap = n / n_clients
    for _ in range(max_draws):
        parts = [[] for _ in range(n_clients)]
        sizes = np.zeros(n_clients, dtype=np.int64)
        for idx in members:
            idx = rng.permutation(idx)
            room = sizes < cap
            p = rng.dirichlet(np.full(n_clients, float(alpha))) * room
            p = p / p.sum() if p.sum() > 0 else room / room.sum()
            cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
            for j, part in enumerate(np.split(idx, cuts)):
                parts[j].append(part)
                sizes[j] += len(part)
        if sizes.min() >= min_size:
            return _finish("dirichlet", [np.concatenate(p) for p in parts])
    raise ValueError(f"dirichlet: none of {max_draws} draws gave every one of {n_clients} clients "
                     f"at least min_size={min_size} samples (alpha={alpha}, {n} samples); raise "
                     f"alpha or max_draws, or lower min_size")


def quantity(labels: np.ndarray, n_clients: int, rng: np.random.Generator, *,
             sigma: float = 0.3) -> Partition:
    """Quantity skew, the "unbalanced" setting of the FedUmf paper's Appendix A: sizes
    n_i ~ LogNormal(log(m/N), sigma) normalised to sum to m (integer sizes by largest
    remainder, each >= 1), then an IID split. sigma = 0 gives equal sizes."""
    if not check_real("quantity", "sigma", sigma) >= 0:
        raise ValueError(f"quantity: sigma must be >= 0, got {sigma!r}")
    sigma = float(sigma)
    m = len(labels)
    _check_clients("quantity", m, n_clients)
    with np.errstate(over="ignore"):
        weights = rng.lognormal(np.log(m / n_clients), sigma, n_clients)
        total = weights.sum()
    if not np.isfinite(total):
        # exp() overflowed: the sizes would be NaN and client 0 given nearly everything
        # whatever the seed
        raise ValueError(f"quantity: sigma = {sigma:g} is too large: the log-normal sizes "
                         f"overflow float64")
    sizes = _apportion(m, weights, lower=1, upper=np.full(n_clients, m))
    return _finish("quantity", np.split(rng.permutation(m), np.cumsum(sizes)[:-1]))


def label_noise(labels: np.ndarray, n_clients: int, rng: np.random.Generator, *,
                rate=None, max_rate: float | None = None,
                num_classes: int | None = None) -> Partition:
    """IID split, then per-client label noise: client i relabels round(rate_i * n_i) of its
    samples, chosen at random, each to a different class drawn uniformly (so the realised flip
    rate is the requested one up to rounding).

    rate: one rate for all clients or a list of N; max_rate: rates spread linearly from 0 to
    max_rate over the clients. Not from a paper: DUW lists data quality as motivation but does
    not test it; this is an extension of ours (e.g. 50% flips on one client).
    """
    labels = _class_labels("label-noise", labels)
    if (rate is None) == (max_rate is None):
        raise ValueError("label-noise: set exactly one of rate (scalar or per-client list) and "
                         "max_rate")
    _check_clients("label-noise", len(labels), n_clients)
    if rate is None:
        rates = np.linspace(0.0, check_real("label-noise", "max_rate", max_rate), n_clients)
    elif isinstance(rate, (list, tuple, np.ndarray)):
        rates = np.array([check_real("label-noise", f"rate[{i}]", r) for i, r in enumerate(rate)],
                         dtype=np.float64)
    else:
        rates = np.full(n_clients, check_real("label-noise", "rate", rate))
    if rates.shape != (n_clients,):
        raise ValueError(f"label-noise: {len(rates)} rates for {n_clients} clients")
    if not np.all((rates >= 0) & (rates <= 1)):
        raise ValueError(f"label-noise: rates must be in [0, 1], got {rates.tolist()}")
    n_classes = int(labels.max()) + 1 if num_classes is None else \
        _positive_int("label-noise", "num_classes", num_classes)
    if n_classes < 2 or labels.max() >= n_classes:
        raise ValueError(f"label-noise: needs at least 2 classes covering the labels, got "
                         f"num_classes={n_classes} with labels up to {int(labels.max())}")
    split = iid(labels, n_clients, rng)
    noisy = []
    for idx, r in zip(split.indices, rates):
        y = labels[idx].copy()
        flip = rng.choice(len(y), size=int(np.floor(r * len(y) + 0.5)), replace=False)
        y[flip] = (y[flip] + rng.integers(1, n_classes, size=len(flip))) % n_classes
        noisy.append(y)
    return Partition(split.indices, tuple(noisy))


def mod(labels: np.ndarray, n_clients: int, rng: np.random.Generator, *,
        num_classes: int | None = None) -> Partition:
    """Node = label mod N, MFL's non-i.i.d. Case 2 (the MFL paper's §7.2.2; also FedVeca's
    Case 2, its §IV-A3), as the code both build on maps it (Wang et al., "Adaptive federated
    learning in resource constrained edge computing systems", JSAC 2019). With N=4 and 10
    digits: {0,4,8}, {1,5,9}, {2,6}, {3,7}.

    Needs N <= C to give every node its own label; for N > C it follows that code: class l
    is spread over the clients n with n mod C = l, least-filled first (a shuffled, equal
    split), so client n holds only class n mod C. Deterministic for N <= C.
    """
    labels = _class_labels("mod", labels)
    _check_clients("mod", len(labels), n_clients)
    n_classes = int(labels.max()) + 1 if num_classes is None else \
        _positive_int("mod", "num_classes", num_classes)
    if labels.max() >= n_classes:
        raise ValueError(f"mod: label {int(labels.max())} is outside num_classes={n_classes}")
    if n_clients <= n_classes:
        return _finish("mod", [np.flatnonzero(labels % n_clients == i) for i in range(n_clients)])
    groups = [[] for _ in range(n_clients)]
    for c in range(n_classes):
        owners = np.arange(c, n_clients, n_classes)
        members = np.count_nonzero(labels == c)
        if members < len(owners):    # else _finish could only name the empty clients, not why
            shown = ", ".join(map(str, owners[:5].tolist())) + (", ..." if len(owners) > 5 else "")
            raise ValueError(f"mod: class {c} has {members} samples for its {len(owners)} "
                             f"clients [{shown}] (client n holds class n mod {n_classes}); use "
                             f"fewer clients or another partition")
        for owner, part in zip(owners, np.array_split(rng.permutation(np.flatnonzero(labels == c)),
                                                      len(owners))):
            groups[owner] = part
    return _finish("mod", groups)


def natural(labels: np.ndarray, n_clients: int, rng: np.random.Generator, *,
            owners: np.ndarray | None = None) -> Partition:
    """Each sample stays with the client that generated it (synthetic data's client_ids,
    the Synthetic(alpha, beta) data of the FedUmf paper's Appendix A). An owner of -1 marks
    a sample no client holds (tools/reproduce.py's label-set environments leave samples
    unused so)."""
    if owners is None:
        raise ValueError("natural: this dataset has no natural clients (client_ids is None); "
                         "use a dataset that has them, such as synthetic")
    owners = np.asarray(owners)
    if owners.shape != (len(labels),):
        raise ValueError(f"natural: {len(owners)} owner ids for {len(labels)} samples")
    _check_clients("natural", len(labels), n_clients)
    # a sample owned by -2 or 0.5 was in no client's split, in silence (-1 says so: unused)
    numeric = owners.dtype != bool and (np.issubdtype(owners.dtype, np.integer)
                                        or np.issubdtype(owners.dtype, np.floating))
    if numeric:
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(owners) | (owners < -1) | (np.mod(owners, 1) != 0)
    else:          # text, booleans, objects: the first one that is no whole number >= -1
        bad = np.array([isinstance(v, bool) or not isinstance(v, (int, np.integer))
                        or v < -1 for v in owners.tolist()], bool)
    if bad.any():
        first = int(np.argmax(bad))
        kind = "" if numeric else f"; they are of dtype {owners.dtype}"
        raise ValueError(f"natural: owners must be client ids 0, 1, ... or -1 (held by no "
                         f"client){kind} (sample {first} has {owners.tolist()[first]!r})")
    owners = owners.astype(np.int64, copy=False)
    n_owners = int(owners.max()) + 1
    if n_clients != n_owners:
        raise ValueError(f"natural: the dataset has {n_owners} natural clients but "
                         f"{n_clients} were requested")
    return _finish("natural", [np.flatnonzero(owners == i) for i in range(n_clients)])


PARTITIONERS = {
    "iid": iid,
    "shards": shards,
    "dirichlet": dirichlet,
    "quantity": quantity,
    "label-noise": label_noise,
    "mod": mod,
    "natural": natural,
}


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------

def _check_clients(name: str, n_samples: int, n_clients: int) -> None:
    _positive_int(name, "clients", n_clients)
    if n_clients > n_samples:
        raise ValueError(f"{name}: {n_clients} clients but only {n_samples} training samples; "
                         f"every client needs at least one")


def _positive_int(name: str, key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: {key} must be a positive integer, got {value!r}")
    return int(value)


def _class_labels(name: str, labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{name}: needs integer class labels, got {labels.dtype} of shape "
                         f"{labels.shape} (regression targets can only be split by iid, "
                         f"quantity or natural)")
    if len(labels) and labels.min() < 0:
        raise ValueError(f"{name}: labels must be >= 0, found {int(labels.min())}")
    return labels


def _apportion(total: int, weights, lower: int, upper) -> np.ndarray:
    """Integers in [lower, upper] summing to `total`, proportional to `weights` where the bounds
    allow (largest remainder); the caller guarantees the bounds admit a solution."""
    weights = np.asarray(weights, dtype=np.float64)
    upper = np.asarray(upper, dtype=np.int64)
    quota = total * weights / weights.sum()
    sizes = np.clip(np.floor(quota).astype(np.int64), lower, upper)
    while sizes.sum() < total:
        gap = np.where(sizes < upper, quota - sizes, -np.inf)
        sizes[np.argmax(gap)] += 1
    while sizes.sum() > total:
        gap = np.where(sizes > lower, sizes - quota, -np.inf)
        sizes[np.argmax(gap)] -= 1
    return sizes


def _finish(name: str, groups) -> Partition:
    indices = tuple(np.sort(np.asarray(g, dtype=np.int64)) for g in groups)
    empty = [i for i, g in enumerate(indices) if g.size == 0]
    if empty:
        raise ValueError(f"{name}: client(s) {empty[:10]} got no samples "
                         f"({len(empty)} of {len(indices)} clients empty); use fewer clients or "
                         f"another partition")
    return Partition(indices)
