"""How much privacy a DP run has spent: (epsilon, delta) after each round, from `dp-accounting`
(Google's maintained accountant; we compose its events, we do not write the analysis).

What one round is, to the accountant
------------------------------------
A round of DP-FedAvg (edgefl.privacy.dp) adds Gaussian noise of standard deviation z * C to
the sum of the selected clients' clipped deltas, and divides by a fixed denominator; with
add/remove-one-client neighbours the sum's L2 sensitivity is C, so the round is a Gaussian
mechanism with noise multiplier z applied to a sample of the clients:

    PoissonSampledDpEvent(q = clients_per_round / clients, GaussianDpEvent(z))    q < 1
    GaussianDpEvent(z)                                                              q = 1

composed over the rounds (`SelfComposedDpEvent`), and epsilon read at the run's delta by
`RdpAccountant` (accountant: rdp) or `PLDAccountant` (accountant: pld).

The approximation, stated: edgefl's sampler (`select_clients`) takes exactly
clients_per_round clients without replacement, not a Poisson sample. DP-FedAvg (McMahan et
al., ICLR 2018, Algorithm 1) selects each client independently with probability q, for
which the Poisson analysis is exact; for a fixed-size sampler it is an approximation (a
common practice, not a proven bound), and it is what this module reports. The event that matches the sampler
exactly is `SampledWithoutReplacementDpEvent`, whose analysis (Wang, Balle, Kasiviswanathan,
AISTATS 2019) holds for replace-one neighbours, where the sensitivity of the sum is 2C, so
its noise multiplier is z / 2; `round_event(..., sampling="without_replacement")` builds it
(RDP only: dp-accounting's PLD has no such event) for whoever wants the strict figure, which
is several times larger (z = 1, q = 0.1, 100 rounds, delta 1e-5: about 8 Poisson, 84
without replacement). With every client in every round (q = 1) there is no sampling and the
two agree that the round is GaussianDpEvent(z).

Both analyses amplify by sampling, which holds only while the sample is secret; edgefl's
is a function of the config's seed, named in every record and announcement, so
`epsilon_selection_known` gives the figure against whoever knows it: the unsampled round
composed over the rounds the most selected client took part in (docs/privacy.md).

Adaptive clipping adds a second noisy query per round (the count of unclipped clients); the
noise split in edgefl.privacy.dp keeps the pair of queries equivalent to one Gaussian with
multiplier z (Andrew et al., NeurIPS 2021, section 3.2), so the event is the same.

`dp-accounting` is the aggregator's extra (`pip install 'edgefl[privacy]'`); a board never
imports this module.
"""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field

from ..errors import ConfigError
from .settings import DifferentialPrivacy

__all__ = ["PrivacyAccountant", "round_event", "noise_for_epsilon", "require_dp_accounting",
           "INSTALL_HINT"]

INSTALL_HINT = "pip install 'edgefl[privacy]'"
SAMPLINGS = ("poisson", "without_replacement")


def require_dp_accounting(where: str = "privacy.dp"):
    """The dp_accounting module, or a ConfigError naming the extra that installs it."""
    try:
        import dp_accounting
        import dp_accounting.pld   # the two accountants' subpackages
        import dp_accounting.rdp
    except ImportError as exc:
        raise ConfigError(f"{where}: accounting a DP run needs the dp-accounting package, "
                          f"which is not installed ({exc}); install it with {INSTALL_HINT} "
                          f"on the aggregator (boards do not need it)") from None
    return dp_accounting


def round_event(noise_multiplier: float, clients: int, clients_per_round: int,
                sampling: str = "poisson"):
    """The DpEvent of one round (the module docstring says which and why)."""
    dpa = require_dp_accounting()
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling {sampling!r}; valid: {', '.join(SAMPLINGS)}")
    if not 1 <= clients_per_round <= clients:
        raise ValueError(f"clients_per_round = {clients_per_round} must be in 1..{clients}")
    if sampling == "without_replacement":
        gaussian = dpa.GaussianDpEvent(noise_multiplier / 2.0)   # replace-one: sensitivity 2C
        if clients_per_round == clients:
            return gaussian
        return dpa.SampledWithoutReplacementDpEvent(clients, clients_per_round, gaussian)
    gaussian = dpa.GaussianDpEvent(noise_multiplier)
    if clients_per_round == clients:
        return gaussian
    return dpa.PoissonSampledDpEvent(clients_per_round / clients, gaussian)


@contextlib.contextmanager
def _quiet_absl():
    """dp-accounting's RDP logs a warning for each fractional order whose series does not
    converge and drops that order (the bound stays valid); a run would print dozens per
    round, so they are held back while it computes."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclass
class PrivacyAccountant:
    """Epsilon of a DP run after r rounds, at the run's delta.

    dp:                the run's `privacy.dp` settings (noise_multiplier z, delta, accountant).
    clients:           the federation's size N.
    clients_per_round: m; the sampling rate is q = m / N.
    sampling:          "poisson" (the default; see the module docstring) or
                       "without_replacement" (RDP only).
    """
    dp: DifferentialPrivacy
    clients: int
    clients_per_round: int
    sampling: str = "poisson"
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        require_dp_accounting()
        if self.sampling == "without_replacement" and self.dp.accountant == "pld":
            raise ConfigError("privacy.dp.accountant: pld has no event for sampling without "
                              "replacement in dp-accounting; use rdp")
        round_event(self.dp.noise_multiplier or 1.0, self.clients, self.clients_per_round,
                    self.sampling)   # checks the sizes once, here

    @property
    def sampling_rate(self) -> float:
        return self.clients_per_round / self.clients

    @property
    def description(self) -> dict:
        """What summary.json says of the accounting."""
        return {"accountant": self.dp.accountant, "delta": self.dp.delta,
                "noise_multiplier": self.dp.noise_multiplier,
                "sampling_rate": self.sampling_rate,
                "sampling": ("none (every client every round)" if self.sampling_rate == 1
                             else "poisson approximation of fixed-size sampling"
                             if self.sampling == "poisson" else "without replacement"),
                "neighbours": "add/remove one client" if self.sampling == "poisson"
                else "replace one client"}

    def epsilon(self, rounds: int) -> float:
        """Epsilon after `rounds` rounds (0 for none, inf without noise)."""
        if rounds <= 0:
            return 0.0
        if self.dp.noise_multiplier == 0:
            return math.inf
        if rounds not in self._cache:
            self._cache[rounds] = self._compute(rounds)
        return self._cache[rounds]

    def _compute(self, rounds: int) -> float:
        dpa = require_dp_accounting()
        one_round = round_event(self.dp.noise_multiplier, self.clients,
                                self.clients_per_round, self.sampling)
        relation = (dpa.NeighboringRelation.ADD_OR_REMOVE_ONE if self.sampling == "poisson"
                    else dpa.NeighboringRelation.REPLACE_ONE)
        with _quiet_absl():
            if self.dp.accountant == "rdp":
                # RDP composes by addition: an RdpAccountant given the round's event r times
                # holds r times the one round's vector of RDP values, so that vector is
                # computed once (0.2 s of series per call) and epsilon read from r times it
                # with dp-accounting's own conversion -- the same numbers, bit for bit
                if "rdp" not in self._cache:
                    single = dpa.rdp.RdpAccountant(neighboring_relation=relation)
                    single.compose(one_round)
                    self._cache["rdp"] = (single.orders, single.rdp)
                orders, per_round = self._cache["rdp"]
                return float(dpa.rdp.compute_epsilon(orders, rounds * per_round,
                                                     self.dp.delta)[0])
            accountant = dpa.pld.PLDAccountant(neighboring_relation=relation)
            accountant.compose(dpa.SelfComposedDpEvent(one_round, rounds))
            return float(accountant.get_epsilon(self.dp.delta))

    def epsilon_selection_known(self, rounds: int) -> float:
        """Epsilon of a client selected in `rounds` rounds, against whoever knows that it
        was: the round's event without its sampling (q = 1), composed that many times.
        Amplification by sampling needs the sample to be secret, and edgefl's is not (the
        "Accounting" in docs/privacy.md says where it is known)."""
        if rounds <= 0:
            return 0.0
        if self.dp.noise_multiplier == 0:
            return math.inf
        dpa = require_dp_accounting()
        unsampled = round_event(self.dp.noise_multiplier, self.clients, self.clients,
                                self.sampling)
        relation = (dpa.NeighboringRelation.ADD_OR_REMOVE_ONE if self.sampling == "poisson"
                    else dpa.NeighboringRelation.REPLACE_ONE)
        with _quiet_absl():
            accountant = (dpa.rdp.RdpAccountant(neighboring_relation=relation)
                          if self.dp.accountant == "rdp"
                          else dpa.pld.PLDAccountant(neighboring_relation=relation))
            accountant.compose(dpa.SelfComposedDpEvent(unsampled, rounds))
            return float(accountant.get_epsilon(self.dp.delta))

    def rounds_within(self, target: float, limit: int) -> int:
        """The most rounds (<= limit) whose epsilon stays <= target: where a budget run
        stops. Epsilon grows with the rounds, so a bisection finds it."""
        if self.epsilon(1) > target:
            return 0
        lo, hi = 1, limit
        if self.epsilon(hi) <= target:
            return hi
        while hi - lo > 1:        # epsilon(lo) <= target < epsilon(hi)
            mid = (lo + hi) // 2
            if self.epsilon(mid) <= target:
                lo = mid
            else:
                hi = mid
        return lo


def noise_for_epsilon(target: float, dp: DifferentialPrivacy, clients: int,
                      clients_per_round: int, rounds: int, *, tolerance: float = 1e-4) -> float:
    """A noise multiplier within `tolerance` of the smallest whose epsilon after `rounds`
    rounds is <= target, never above the target: how an experiment picks z for a target
    epsilon. dp-accounting's own calibration (`calibrate_dp_mechanism`, Brent's method with
    a final check that the budget holds) does the search."""
    dpa = require_dp_accounting()

    def make_event(z):
        return dpa.SelfComposedDpEvent(round_event(z, clients, clients_per_round), rounds)

    def make_accountant():
        if dp.accountant == "pld":
            return dpa.pld.PLDAccountant()
        return dpa.rdp.RdpAccountant()

    with _quiet_absl():
        z = dpa.calibrate_dp_mechanism(
            make_accountant, make_event, target, dp.delta,
            bracket_interval=dpa.ExplicitBracketInterval(0.05, 100.0),
            tol=tolerance)
    return float(z)

