"""The secure rounds of `edgefl simulate` in process: each round's sum comes from the real
SecAgg+ protocol (edgefl.privacy.secagg) run between the round's in-process clients -- real
key agreement, real masks, the same message objects a transport would encode (encoding them
here would only copy every masked vector twice; tests/test_secagg.py runs rounds through the
encoding) -- and the round engine closes from the unmasked sum
(`RoundEngine.close_round_from_sum`)."""
from __future__ import annotations

from typing import Callable, Mapping

from ..privacy import secagg
from ..privacy.settings import SecureAggregation
from ..rounds import RoundEngine, RoundPlan, UploadTotals
from ..strategies import Contribution

__all__ = ["in_process_secure_sum"]


def in_process_secure_sum(settings: SecureAggregation, run_id: str, seed: int,
                          vanish: Callable[[int], Mapping] | None = None):
    """The `secure_sum` callable of `run_federation`: (engine, plan, contributions) ->
    (SumTotal, UploadTotals, record extras).

    The quantiser's max_weight is the largest weight among the round's contributions: the
    simulator holds every client's data, so it knows this bound; a deployment states it.
    Each client rounds with its task's seed, so a secure run is reproducible (and the same
    over any transport). `vanish(round)` -> {phase: clients} makes clients drop out of a
    round's protocol (secagg.run_in_process), to try dropouts; a round left below its
    threshold raises secagg.SecAggAborted out of run_federation, after the records of the
    rounds before it and with nothing of this round applied."""

    def secure_sum(engine: RoundEngine, plan: RoundPlan,
                   contributions: Mapping[int, Contribution]):
        first = contributions[min(contributions)]
        setup = secagg.round_setup(
            settings, run_id=run_id, round=plan.round, participants=sorted(contributions),
            seed=seed, vector_size=first.vector.size, scalar_names=first.scalars,
            max_weight=max(c.weight for c in contributions.values()))
        server = secagg.run_in_process(
            setup, contributions, {c: plan.tasks[c].train["seed"] for c in contributions},
            vanish=None if vanish is None else vanish(plan.round))
        total = server.total
        extras = {"secure": {"survivors": total.count, "dropped": list(server.dropped),
                             "ring_bits": setup.ring_bits, "levels": setup.levels,
                             "threshold": setup.threshold}}
        return total, UploadTotals.of_sum(total, server.uplink_bytes()), extras

    return secure_sum
