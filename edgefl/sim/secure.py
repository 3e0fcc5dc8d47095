"""The secure rounds of `edgefl simulate` in process: each round's sum comes from the real
SecAgg+ protocol (edgefl.privacy.secagg) run between the round's in-process clients -- real
key agreement, real masks, the same message objects a transport would encode (encoding them
here would only copy every masked vector twice; tests/test_secagg.py runs rounds through the
encoding) -- and the round engine closes from the unmasked sum
(`RoundEngine.close_round_from_sum`).

The phases that need no contribution run while the clients train, as they would on boards:
`begin` (called by run_federation when a round opens) starts a thread that runs the key
advertisement, the key sharing and every client's mask expansion (the AES keystreams, most of
a secure round's cost: SecAggClient.expand_masks), with the setup the MQTT aggregator
announces (its weight bound from the sample counts, the vector's size left to the masked
inputs). The call after training then only quantises, adds, and unmasks. When the round's
contributions are not the ones foreseen (an upload refused, a late client, a weight other
than the sample count) the prepared round is dropped and the whole protocol runs then, with
the setup from the contributions -- the sum, and so the model, are the same bits either way,
since the masks cancel and the quantiser is the same."""
from __future__ import annotations

import queue
import threading
from typing import Callable, Mapping, Sequence

from ..privacy import secagg
from ..privacy.settings import SecureAggregation
from ..rounds import RoundEngine, RoundPlan, UploadTotals
from ..strategies import Contribution

__all__ = ["in_process_secure_sum", "InProcessSecureSum"]


def in_process_secure_sum(settings: SecureAggregation, run_id: str, seed: int,
                          vanish: Callable[[int], Mapping] | None = None) \
        -> "InProcessSecureSum":
    """The `secure_sum` callable of `run_federation`: (engine, plan, contributions) ->
    (SumTotal, UploadTotals, record extras).

    The quantiser's max_weight is the largest weight among the round's contributions: the
    simulator holds every client's data, so it knows this bound; a deployment states it.
    Each client rounds with its task's seed, so a secure run is reproducible (and the same
    over any transport). `vanish(round)` -> {phase: clients} makes clients drop out of a
    round's protocol (secagg.run_in_process), to try dropouts; a round left below its
    threshold raises secagg.SecAggAborted out of run_federation, after the records of the
    rounds before it and with nothing of this round applied."""
    return InProcessSecureSum(settings, run_id, seed, vanish)


class InProcessSecureSum:
    """See `in_process_secure_sum`; `begin` runs a round's first phases during training."""

    def __init__(self, settings: SecureAggregation, run_id: str, seed: int,
                 vanish: Callable[[int], Mapping] | None = None):
        self.settings, self.run_id, self.seed, self.vanish = settings, run_id, seed, vanish
        self._ahead = None          # the round begun: _Ahead
        # {client: words} each client's masks are expanded into, kept between rounds: fresh
        # pages for 10 vectors a round cost a fault per 4 kB, in the kernel, contending with
        # the training thread's own
        self._buffers: dict = {}

    def _setup(self, round: int, participants: Sequence[int], max_weight: int, **sizes):
        return secagg.round_setup(self.settings, run_id=self.run_id, round=round,
                                  participants=participants, seed=self.seed,
                                  max_weight=max_weight, **sizes)

    def begin(self, engine: RoundEngine, plan: RoundPlan, training: Sequence[int],
              clients: Mapping) -> Callable[[int, Contribution], None] | None:
        """A round opened and `training` (clients with their LocalData in `clients`) start
        training: run the keys and shares phases and expand the masks meanwhile, on one
        thread beside them (the masks' AES releases the GIL). Returns the function to call
        with each client's contribution as soon as it exists (its masked input is then made
        and summed on that thread too), or None when there is nothing to begin."""
        participants = sorted(c for c in training if plan.tasks[c].upload)
        self.close()
        if len(participants) < 2:
            return None
        max_weight = secagg.max_weight_of(engine.strategy,
                                          {c: clients[c].num_samples for c in participants})
        buffers = plan.tasks[participants[0]].buffers
        size = buffers["params"].size if "params" in buffers else None
        try:
            setup = self._setup(plan.round, participants, max_weight, vector_size=None,
                                scalar_names=None)
        except secagg.SecAggError:    # a ring too small for the foreseen weights: the round
            return None               # runs after training, refused there if it must be
        self._ahead = ahead = _Ahead(setup, size, {c: plan.tasks[c].train["seed"]
                                                   for c in participants},
                                     None if self.vanish is None else self.vanish(plan.round),
                                     self._buffers)
        return ahead.contributed

    def close(self) -> None:
        """Stop a round begun and never summed (the run ended in its training): its thread
        ends, and what it holds is freed."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.stop()

    def __call__(self, engine: RoundEngine, plan: RoundPlan,
                 contributions: Mapping[int, Contribution]):
        participants = sorted(contributions)
        max_weight = max(c.weight for c in contributions.values())
        seeds = {c: plan.tasks[c].train["seed"] for c in contributions}
        ahead, self._ahead = self._ahead, None
        prepared = None if ahead is None else ahead.result(plan.round, participants,
                                                           max_weight, contributions)
        if prepared is None:
            first = contributions[participants[0]]
            setup = self._setup(plan.round, participants, max_weight,
                                vector_size=first.vector.size, scalar_names=first.scalars)
            prepared = secagg.InProcessRound(
                setup, vanish=None if self.vanish is None else self.vanish(plan.round))
        server = prepared.finish(contributions, seeds)
        setup, total = server.setup, server.total
        extras = {"secure": {"survivors": total.count, "dropped": list(server.dropped),
                             "ring_bits": setup.ring_bits, "levels": setup.levels,
                             "threshold": setup.threshold}}
        return total, UploadTotals.of_sum(total, server.uplink_bytes()), extras


class _Ahead:
    """One round's protocol run ahead, on its own thread: the keys and shares phases, every
    client's mask expansion, then each masked input as its contribution comes in."""

    def __init__(self, setup: secagg.RoundSetup, size: int | None, seeds: Mapping[int, int],
                 vanish: Mapping | None, buffers: dict):
        self.setup, self.size, self.seeds, self.vanish = setup, size, seeds, vanish
        self.buffers = buffers       # the round's masked inputs are these words: one round
        #                              at a time (begin stops the one before)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.given: dict = {}        # {client: the contribution handed to the thread}
        self.prepared = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="edgefl-secagg-ahead",
                                       daemon=True)
        self.thread.start()

    def contributed(self, client: int, contribution: Contribution) -> None:
        """Client `client`'s contribution exists (called from the training threads)."""
        if client in self.seeds:
            self.given[client] = contribution
            self.inbox.put((client, contribution))

    def _run(self) -> None:
        try:
            prepared = secagg.InProcessRound(self.setup, vanish=self.vanish)
            if self.size is not None:
                prepared.expand_masks(self.size, threads=1, buffers=self.buffers)
            self.prepared = prepared
        except BaseException as exc:     # raised where the round needs it (result)
            self.error = exc
        while True:
            item = self.inbox.get()
            if item is None:
                return
            if self.error is None:
                c, contribution = item
                try:
                    self.prepared.send_masked(c, contribution, self.seeds[c])
                except BaseException as exc:
                    self.error = exc

    def stop(self) -> None:
        """No more contributions: the thread ends once it has handled those it has."""
        self.inbox.put(None)
        self.thread.join()

    def result(self, round: int, participants: list, max_weight: int,
               contributions: Mapping[int, Contribution]):
        """The prepared round when the contributions are the ones it foresaw (the same
        clients, weight bound and objects), else None; the thread's error, if it failed."""
        self.stop()
        if (round, participants, max_weight) != (self.setup.round, list(self.setup.participants),
                                                 self.setup.max_weight) \
                or any(contributions.get(c) is not x for c, x in self.given.items()):
            return None
        if self.error is not None:
            raise self.error
        return self.prepared
