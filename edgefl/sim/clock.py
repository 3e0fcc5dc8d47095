"""The virtual clock of `edgefl simulate`: how long each local round takes on the simulated
fleet, and the event queue the asynchronous driver runs on.

A task's time is its download, its local training and its upload, one after the other:

    seconds = bytes_down / link + 6 * n_params * samples / rate + bytes_up / link

where samples is what the local round processes (steps x batch, or epochs x |D_i|), 6 FLOPs
per parameter and sample is the usual estimate of a dense network's forward and backward pass
(it undercounts convolutions, which reuse each weight at many positions), rate is the board's
training GFLOP/s and link its Mbit/s (edgefl.virtual_fleet.BOARDS, or the config's
overrides), and the bytes are the float32 bytes of the task's buffers scaled by the
profile's compression (the upload is taken to be as large as the download: a model in, a
model out). With
`sim_fleet.jitter` sigma > 0 the whole is multiplied by exp(sigma z - sigma^2 / 2), z standard
normal drawn from the task's own seed (the (seed, round, client) seed of its local round), a
factor of mean 1 that makes a board slower or faster from one task to the next. Nothing here
reads a real clock, so simulated times are the same on any machine and for any number of
threads.

Without a `sim_fleet:` section (`Clock.lockstep`) every task takes one simulated second: the
asynchronous driver then runs its clients in lock step, and FedBuff with K = C is synchronous
FedAvg round for round.

EventQueue orders events by (time, sequence number): events at the same simulated time come
out in the order they were pushed, so ties are broken the same way in every run.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ..virtual_fleet import assign_profiles, boards_of, compression_ratio

__all__ = ["Clock", "EventQueue", "FLOPS_PER_PARAM_SAMPLE"]

FLOPS_PER_PARAM_SAMPLE = 6
_FLEET_STREAM = 0xF1EE7      # separates the profile assignment from the run's other streams
_JITTER_STREAM = 0x717E4     # separates a task's jitter from its data order


@dataclass(frozen=True)
class Clock:
    """Seconds of each client's tasks on the simulated fleet.

    profile:   {client: profile name} (empty for lockstep).
    gflops, bandwidth_mbps, wire_ratio: {client: value}.
    n_params:  the model's parameter count.
    deadline_s: synchronous rounds close at this many seconds at the latest (0: never).
    jitter:    sigma of the log-normal factor on each task's time (0: none).
    """
    profile: Mapping[int, str] = field(default_factory=dict)
    gflops: Mapping[int, float] = field(default_factory=dict)
    bandwidth_mbps: Mapping[int, float] = field(default_factory=dict)
    wire_ratio: Mapping[int, float] = field(default_factory=dict)
    n_params: int = 0
    deadline_s: float = 0.0
    jitter: float = 0.0

    @classmethod
    def lockstep(cls) -> "Clock":
        return cls()

    @classmethod
    def for_fleet(cls, fleet: Mapping, clients, seed: int, n_params: int) -> "Clock":
        """The clock of a resolved `sim_fleet:` section (edgefl.virtual_fleet) for these client
        ids; the profiles are dealt to the clients from the run seed."""
        rng = np.random.default_rng((int(seed), _FLEET_STREAM))
        profile = assign_profiles(fleet["mix"], clients, rng)
        boards = boards_of(fleet)
        ratio = {name: compression_ratio(name) for name in boards}
        return cls(profile, {c: boards[p].gflops for c, p in profile.items()},
                   {c: boards[p].bandwidth_mbps for c, p in profile.items()},
                   {c: ratio[p] for c, p in profile.items()}, int(n_params),
                   float(fleet["deadline_s"]), float(fleet.get("jitter", 0.0)))

    @property
    def is_lockstep(self) -> bool:
        return not self.profile

    def task_seconds(self, client: int, task, num_samples: int) -> float:
        """Simulated seconds from sending `task` to `client` to its update arriving."""
        if self.is_lockstep:
            return 1.0
        cfg = task.train
        batch = cfg["batch_size"] or num_samples
        samples = cfg["steps"] * batch if cfg["steps"] > 0 else cfg["epochs"] * num_samples
        compute = FLOPS_PER_PARAM_SAMPLE * self.n_params * samples / (self.gflops[client] * 1e9)
        wire = 2 * task.nbytes * self.wire_ratio[client] * 8 / (self.bandwidth_mbps[client] * 1e6)
        if self.jitter:
            z = np.random.default_rng((int(cfg["seed"]), _JITTER_STREAM)).standard_normal()
            return (compute + wire) * float(np.exp(self.jitter * z - self.jitter ** 2 / 2))
        return compute + wire

    def round_seconds(self, r: int, seconds: Mapping[int, float]) -> tuple:
        """(duration, late clients) of synchronous round r whose uploaders take `seconds`:
        the slowest one's time, or the deadline when some are not done by then (those are
        late: stopped, their work lost). ValueError naming sim_fleet.deadline_s when none is
        in time."""
        if not seconds:
            return 0.0, frozenset()
        slowest = max(seconds.values())
        if not self.deadline_s or slowest <= self.deadline_s:
            return slowest, frozenset()
        late = frozenset(c for c, s in seconds.items() if s > self.deadline_s)
        if len(late) == len(seconds):
            raise ValueError(f"sim_fleet.deadline_s = {self.deadline_s:g}: no client of round "
                             f"{r} finishes in time (the fastest takes "
                             f"{min(seconds.values()):.3g} s)")
        return self.deadline_s, late

    def describe(self) -> dict:
        """{profile: number of clients} for the summary."""
        counts: dict = {}
        for name in self.profile.values():
            counts[name] = counts.get(name, 0) + 1
        return dict(sorted(counts.items()))


class EventQueue:
    """A priority queue of (time, payload) in time order, ties in push order."""

    def __init__(self):
        self._heap: list = []
        self._seq = itertools.count()

    def push(self, time: float, payload: Any) -> None:
        heapq.heappush(self._heap, (float(time), next(self._seq), payload))

    def __len__(self) -> int:
        return len(self._heap)

    def pop_simultaneous(self) -> tuple:
        """(time, [payloads]) of every event at the earliest time, in push order."""
        time, _, payload = heapq.heappop(self._heap)
        out = [payload]
        while self._heap and self._heap[0][0] == time:
            out.append(heapq.heappop(self._heap)[2])
        return time, out
