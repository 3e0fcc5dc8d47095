"""The two places differential privacy acts on a round that sums (`PrivacyHooks`), and the
no-op default. The package docstring says where the round engine calls them."""
from __future__ import annotations

from typing import Mapping

import numpy as np

__all__ = ["PrivacyHooks", "NO_HOOKS", "BudgetExhausted", "task_generator"]


class BudgetExhausted(RuntimeError):
    """Raised by `PrivacyHooks.server_sum` when applying this round would spend more privacy
    budget than the run may: the round is not applied and the run ends with the model of the
    round before (the message says why: epsilon so far, the target)."""


class PrivacyHooks:
    """What DP does to a summing round; subclass and override. This base does nothing, so a
    round with these hooks is the plain sum-based round.

    client_delta(delta, rng) -> delta
        On the client, before the strategy's weight is folded in and before masking: the
        contribution's float32 vector (the client's update as a delta from the task's
        model). Return the vector to sum instead (clipped, with the client's share of the
        noise); it may be `delta` changed in place. `rng` is the client's
        numpy Generator for this round.
    server_sum(total, round) -> total
        On the server, once the sum is known (unmasked, or summed in the clear) and before
        the strategy's server step: return the SumTotal to step with (central noise, an
        adaptive clip's update, the accountant's step). Raise BudgetExhausted to end the run.
    round_metrics(round) -> {name: value}
        Fields for round `round`'s record (epsilon spent so far, the clip), added after the
        strategy's metrics.
    before_round(round)
        On the server, before round `round` opens: raise BudgetExhausted when the round
        could not be applied anyway, so no client trains for nothing (a DP budget is
        known in advance; `server_sum` keeps the same check as the guard).
    allows(round) -> bool
        Whether round `round` may run (before_round would not raise): the engine asks it for
        the round after the one it closes, which is the run's last when the answer is no.
    """

    def client_delta(self, delta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return delta

    def server_sum(self, total, round: int):
        return total

    def round_metrics(self, round: int) -> Mapping:
        return {}

    def before_round(self, round: int) -> None:
        return None

    def allows(self, round: int) -> bool:
        try:
            self.before_round(round)
        except BudgetExhausted:
            return False
        return True


NO_HOOKS = PrivacyHooks()


PRIVACY_STREAM = 0xD9     # separates a client's DP draws from its training seed


def task_generator(task) -> np.random.Generator:
    """The Generator a simulation hands `client_delta` for `task`: seeded from the task's
    training seed, so an in-process run and the same run over a broker (where the central-DP
    aggregator runs the hook) draw the same numbers. A board draws its own."""
    return np.random.default_rng([task.train["seed"], PRIVACY_STREAM])
