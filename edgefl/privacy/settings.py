"""The `privacy:` section of a run config, as values: what a run asks of secure aggregation
and of differential privacy. Reading and checking the YAML is `edgefl.runconfig`'s (it names
the key in every error); the protocols that use these values are this package's other modules.

    privacy:
      secure_aggregation:        # SecAgg+: the aggregator learns only the sum of the updates
        threshold: 0.67          # t, the survivors needed to unmask: a fraction of the round's
                                 #   participants in (0.5, 1], or a count > half of them
        neighbours: 0            # k, each client's masking neighbours; 0 = all (SecAgg)
        ring_bits: 32            # arithmetic in Z_(2^32) or Z_(2^64)
        clip_range: 8.0          # each quantised value is clipped to [-clip_range, clip_range]
        max_attempts: 5          # over a broker: failed attempts of one round (a phase left
                                 #   below t) before the run stops, naming the boards
      dp:                        # client-level differential privacy (DP-FedAvg)
        mode: central            # central (the aggregator adds the noise) | distributed
        clip: 1.0                # each client's update is clipped to this L2 norm
        noise_multiplier: 1.0    # the noise's standard deviation is noise_multiplier * clip
        delta: 1.0e-5
        target_epsilon: null     # budget mode: the run ends before epsilon would pass this
        accountant: rdp          # rdp | pld (dp-accounting)
        adaptive_clip: null      # or {target_quantile: 0.5, lr: 0.2, count_noise: ...}
        reproducible: false      # true: noise seeded from (seed, round, client), for tests and
                                 #   experiments only (anyone knowing the seed can remove it)

Which strategies can run under each is decided where the strategies are (`secure_sum` on the
strategy); the check is `refusal` below, called by the run config.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

__all__ = ["SecureAggregation", "DifferentialPrivacy", "AdaptiveClip", "Privacy",
           "refusal", "SECAGG_KEYS", "DP_KEYS", "ADAPTIVE_KEYS", "DP_MODES", "ACCOUNTANTS", "RING_BITS"]

DP_MODES = ("central", "distributed")
ACCOUNTANTS = ("rdp", "pld")
RING_BITS = (32, 64)


@dataclass(frozen=True)
class SecureAggregation:
    threshold: float = 0.67     # a fraction (<= 1) of the round's participants, or a count
    neighbours: int = 0
    ring_bits: int = 32
    clip_range: float = 8.0
    # a round over a broker whose phase ends below t is announced again (fresh keys); boards
    # that stay silent without refusing, or keep sending another shape, would have it
    # announced for ever: after this many failed attempts the run stops, naming them.
    # Added after runs were checkpointed: left out of to_dict at its default (_plain)
    max_attempts: int = field(default=5, metadata={"since_checkpoints": True})

    def threshold_count(self, participants: int) -> int:
        """t for a round of `participants` clients: the count itself, or the fraction rounded
        up (at least 2 would be meaningless for one participant; a round of one cannot be
        secure, and the protocol refuses it)."""
        if self.threshold > 1:
            return int(self.threshold)
        return max(1, math.ceil(self.threshold * participants - 1e-9))


@dataclass(frozen=True)
class AdaptiveClip:
    target_quantile: float = 0.5
    lr: float = 0.2
    count_noise: float | None = None   # None: the paper's default, clients_per_round / 20


@dataclass(frozen=True)
class DifferentialPrivacy:
    mode: str = "central"
    clip: float = 1.0
    noise_multiplier: float = 1.0
    delta: float = 1e-5
    target_epsilon: float | None = None
    accountant: str = "rdp"
    adaptive_clip: AdaptiveClip | None = None
    reproducible: bool = False


@dataclass(frozen=True)
class Privacy:
    secure_aggregation: SecureAggregation | None = None
    dp: DifferentialPrivacy | None = None

    def to_dict(self) -> dict:
        out: dict[str, Any] = {}
        if self.secure_aggregation is not None:
            out["secure_aggregation"] = _plain(self.secure_aggregation)
        if self.dp is not None:
            out["dp"] = _plain(self.dp)
        return out


SECAGG_KEYS = tuple(f.name for f in fields(SecureAggregation))
DP_KEYS = tuple(f.name for f in fields(DifferentialPrivacy))
ADAPTIVE_KEYS = tuple(f.name for f in fields(AdaptiveClip))


def _plain(value) -> dict:
    """A section as the dict its config would give. A setting added after runs were
    checkpointed is left out at its default: the dict is in each run's fingerprint
    (roles.aggregator.run_fingerprint), and a run stopped before the setting existed must
    resume after an upgrade, not be refused as "another configuration"."""
    out = {}
    for f in fields(value):
        item = getattr(value, f.name)
        if f.metadata.get("since_checkpoints") and item == f.default:
            continue
        out[f.name] = _plain(item) if hasattr(item, "__dataclass_fields__") else item
    return out


def refusal(privacy: Privacy, strategy, robust: Mapping | None, attack: Mapping | None) -> \
        tuple[str, str] | None:
    """(key, reason) when this run's strategy cannot run under `privacy`, else None.

    Secure aggregation and DP both hand the server step a (noisy or masked) weighted sum of
    the clients' updates and nothing else, so they serve the strategies whose server step
    needs only that sum (`strategy.secure_sum`); robust aggregation and simulated attacks
    look at each client's update, which is exactly what is hidden."""
    key = "privacy.secure_aggregation" if privacy.secure_aggregation is not None else "privacy.dp"
    if not getattr(strategy, "secure_sum", False):
        why = getattr(strategy, "secure_sum_refusal", "") or \
            "its server step reads each client's update, not only their weighted sum"
        return key, f"strategy {strategy.name!r} cannot run with it: {why}"
    if robust:
        return key, ("robust aggregation (strategy.robust) ranks or trims the individual "
                     "updates, which secure aggregation and DP hide; drop one of the two")
    if attack:
        return key, ("the attack simulation (attack:) tampers with individual updates in the "
                     "clear; run it without the privacy section")
    if privacy.dp is not None:
        why = getattr(strategy, "dp_refusal", "")
        if why:
            return "privacy.dp", f"strategy {strategy.name!r} cannot run with it: {why}"
        weighting = getattr(strategy, "weighting", "uniform")
        if weighting != "uniform":
            return "strategy.weighting", (
                f"{weighting!r} cannot run with privacy.dp: DP-FedAvg bounds one client's "
                f"effect on the sum only when every client has the same weight (a client "
                f"reports its own sample count); set strategy.weighting: uniform")
    return None
