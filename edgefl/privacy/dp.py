"""Client-level differential privacy for federated rounds: DP-FedAvg (McMahan, Ramage, Talwar,
Zhang, "Learning Differentially Private Recurrent Language Models", ICLR 2018), with optional
adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with
Adaptive Clipping", NeurIPS 2021).

The mechanism, per round t with clip norm C_t and noise multiplier z:

    client i:    delta_i = w_i - w_t                       (its trained model minus the global)
                 delta_i <- delta_i * min(1, C_t / ||delta_i||_2)          (`clip_delta`;
                             under secure aggregation C_t less the quantiser's rounding,
                             `DPHooks.clip_bound`, so the quantised delta is within C_t)
    aggregator:  S = sum_i delta_i + N(0, (sigma_delta * C_t)^2 I)
                 w_{t+1} = w_t + S / m                     (the strategy's server step on S)

Choices, and why:

- **Uniform weights, fixed denominator.** The sensitivity of the sum to one client is C only
  if every client's weight is bounded and known; sample-count weights would let one client
  with a large |D_i| (which it reports itself) dominate. So under DP each client's delta has
  weight 1 and the sum is divided by m = clients_per_round (the expected number of
  participants, DP-FedAvg's fixed denominator qW), not by the number that came up: a
  round with dropouts moves the model a little less, and its sensitivity stays C / m.
- **Central noise** (mode: central): the aggregator adds all the noise to the sum; the
  aggregator is trusted to do so, and sees the clipped deltas.
- **Distributed noise** (mode: distributed, with secure aggregation): each of the m
  selected clients adds N(0, sigma_delta^2 C^2 / m) to its own clipped delta before masking,
  so the sum of the m shares has the full variance and the aggregator, which learns only the
  sum, never sees a delta with less noise than that. The assumption: the clients are honest
  (a client that skips its share weakens everyone's guarantee), and all m shares arrive.
  With dropouts only the survivors' shares are in the sum, whose noise std is then
  sigma_delta C sqrt(s / m) for s survivors: short. What we do: the aggregator tops the sum
  up with N(0, sigma_delta^2 C^2 (m - s) / m) itself (`topup_std`), so the released sum
  carries the full noise again; the top-up is central noise, so for that round the
  guarantee against the aggregator itself is the one of the s shares (reported in the
  round's record as `dp_noise_shortfall`), and against everyone else the full one.
- **The noise generator.** Noise must be unpredictable: on a real run each draw comes from a
  NumPy Generator seeded with 128 bits from `secrets` (the OS's CSPRNG). With
  `privacy.dp.reproducible: true` the generator is seeded from (run seed, round, client)
  instead, so a run can be repeated bit for bit (tests, the experiments in docs/privacy.md);
  anyone who knows the run's seed can then subtract the noise, so a deployment must not set
  it. (NumPy's Gaussian sampler is a floating-point one; the known attacks on floating-point
  noise (Mironov, CCS 2012, on the Laplace mechanism; Jin et al., IEEE S&P 2022, on Gaussian
  samplers too) are not addressed.)
- **Adaptive clipping.** Each client also reports whether its delta was within the clip,
  as the centred bit b_i - 1/2 (sensitivity 1/2); the aggregator adds N(0, sigma_b^2) to
  their sum, and with b~ = (sum + noise) / m + 1/2, the noised fraction within C,

      C_{t+1} = C_t * exp(-lr * (b~ - target_quantile))      (the paper's geometric update)

  The two noisy queries together are a Gaussian mechanism with multiplier z when the
  deltas' noise multiplier is sigma_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2) (the paper's
  noise split, section 3.2), which needs 2 sigma_b > z. sigma_b defaults to m / 20, the
  paper's choice (the fraction's noise std is then 1/20).
"""
from __future__ import annotations

import math
import secrets
import threading
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from .. import kernels
from ..errors import ConfigError
from ..strategies import StrategyError
from .accountant import PrivacyAccountant
from .hooks import BudgetExhausted, PrivacyHooks
from .settings import DifferentialPrivacy

__all__ = ["clip_delta", "DPMechanism", "DPHooks", "noise_generator", "add_gaussian",
           "NOISE_STREAM"]

NOISE_STREAM = 0xD1FF   # separates the noise seeds from selection and training seeds
AGGREGATOR = -1         # the "client" id of the aggregator's own draws


def clip_delta(delta: np.ndarray, clip: float) -> tuple[np.ndarray, float]:
    """(delta scaled to L2 norm <= clip, its norm before clipping). The norm is the C core's
    float64 sum of squares; a delta already within the clip is returned unchanged (a copy is
    made only when it is scaled). A non-finite delta has no norm and is refused."""
    norm = math.sqrt(kernels.sqnorm(delta))
    if not math.isfinite(norm):
        raise ValueError("the update's delta is not finite; it cannot be clipped")
    if norm <= clip:
        return delta, norm
    out = np.array(delta, dtype=np.float32, copy=True)
    # float32 rounding of the scaled values can leave the norm a few ulps above the clip;
    # the factor's 2^-20 margin keeps the bound exact at a negligible cost
    kernels.scale(out, clip / norm * (1.0 - 2.0 ** -20))
    return out, norm


def noise_generator(seed: int | None, round: int, who: int) -> np.random.Generator:
    """The Generator for one draw of noise: from (seed, round, who) when the run asked for
    reproducible noise (seed not None), else from 128 fresh bits of the OS's CSPRNG."""
    if seed is None:
        return np.random.default_rng(secrets.randbits(128))
    return np.random.default_rng([int(seed) & (2**63 - 1), NOISE_STREAM, int(round),
                                  int(who) & (2**63 - 1)])


def add_gaussian(x: np.ndarray, std: float, rng: np.random.Generator) -> np.ndarray:
    """A new float32 buffer x + N(0, std^2 I), the noise drawn in float64."""
    out = np.asarray(x, dtype=np.float64) + rng.normal(0.0, std, size=np.shape(x))
    return out.astype(np.float32)


@dataclass(frozen=True)
class DPMechanism:
    """The numbers of a run's DP rounds: who adds what noise, and how C moves.

    dp:                the run's `privacy.dp` settings.
    clients_per_round: m, the fixed denominator and the number of noise shares.
    """
    dp: DifferentialPrivacy
    clients_per_round: int

    def __post_init__(self):
        a = self.dp.adaptive_clip
        if a is not None and self.dp.noise_multiplier > 0 and \
                not 2 * self.count_noise > self.dp.noise_multiplier:
            raise ConfigError(
                f"privacy.dp.adaptive_clip.count_noise: {self.count_noise:g} is too small for "
                f"noise_multiplier {self.dp.noise_multiplier:g}: the noise split needs "
                f"2 * count_noise > noise_multiplier (Andrew et al. 2021, section 3.2); "
                f"give count_noise > {self.dp.noise_multiplier / 2:g}")

    @property
    def count_noise(self) -> float:
        """sigma_b: the noise std on the sum of centred clip bits (0 without adaptive clip),
        all of it added by the aggregator, which alone sees the bits: adaptive clipping is
        refused with secure aggregation, so never runs in distributed mode."""
        a = self.dp.adaptive_clip
        if a is None:
            return 0.0
        return a.count_noise if a.count_noise is not None else self.clients_per_round / 20

    @property
    def delta_noise_multiplier(self) -> float:
        """sigma_delta: the multiplier of the noise on the deltas' sum. It is z itself
        without adaptive clipping; with it, the paper's split leaves a part of the budget to
        the count, so the deltas get more noise than z."""
        z = self.dp.noise_multiplier
        if self.dp.adaptive_clip is None or z == 0 or self.count_noise == 0:
            return z
        return (z ** -2 - (2 * self.count_noise) ** -2) ** -0.5

    def sum_noise_std(self, clip: float) -> float:
        """The std of the noise the released sum carries, per coordinate."""
        return self.delta_noise_multiplier * clip

    def share_std(self, clip: float) -> float:
        """The std of one client's share in distributed mode (0 in central mode)."""
        if self.dp.mode != "distributed":
            return 0.0
        return self.sum_noise_std(clip) / math.sqrt(self.clients_per_round)

    def server_std(self, clip: float, shares: int) -> float:
        """The noise the aggregator adds to a sum that already carries `shares` clients'
        noise shares: all of it in central mode, the top-up for the missing shares in
        distributed mode (zero when all m arrived)."""
        if self.dp.mode != "distributed":
            return self.sum_noise_std(clip)
        missing = max(0, self.clients_per_round - shares)
        return self.sum_noise_std(clip) * math.sqrt(missing / self.clients_per_round)

    def next_clip(self, clip: float, centred_count: float) -> float:
        """C_{t+1} from C_t and the noised sum of centred bits (b_i - 1/2) over the round:
        the geometric update toward the target quantile of the update norms."""
        a = self.dp.adaptive_clip
        if a is None:
            return clip
        fraction = centred_count / self.clients_per_round + 0.5
        return float(clip * math.exp(-a.lr * (fraction - a.target_quantile)))


class DPHooks(PrivacyHooks):
    """DP-FedAvg on a summing round (edgefl.privacy's docstring says where the engine calls
    each method): the client side clips and, in distributed mode, adds its noise share; the
    server side checks the budget, adds the central noise (or the top-up for missing shares),
    fixes the denominator at m, steps the adaptive clip and keeps the round's record fields.

    One object serves a run. In central mode the aggregator may run `client_delta` itself on
    each update it receives (it is trusted with them, and the clients then need nothing);
    in distributed mode each client runs it. Adaptive clipping needs the clip bits of the
    round's clients, which `client_delta` counts in this object, so it runs in central mode
    only (the config refuses it with distributed noise: the clip would have to travel to the
    clients and the bits through the secure sum).

    A resumed aggregator restores the clip from its history (`resume`); epsilon after a
    round depends only on the round number, so the accountant needs nothing restored.
    """

    def __init__(self, dp: DifferentialPrivacy, clients: int, clients_per_round: int,
                 seed: int, *, server: bool = True, rounding: float = 0.0):
        self.dp = dp
        # the secure quantiser's level (`rounding_of`), 0 without secure aggregation: each
        # value of the clipped delta is rounded to a level before masking, and the clip
        # leaves room for that (`clip_bound`)
        self.rounding = float(rounding)
        self.mechanism = DPMechanism(dp, clients_per_round)
        self.clients_per_round = clients_per_round
        # the accountant (and dp-accounting) is the aggregator's; a board's hooks only clip
        # and add their noise share
        self.accountant = PrivacyAccountant(dp, clients, clients_per_round) if server else None
        self.seed = int(seed) if dp.reproducible else None
        self.clip = float(dp.clip)
        self._lock = threading.Lock()
        self._bits = [0, 0]          # this round's clients within the clip, and all of them
        self._metrics: dict = {}

    @classmethod
    def for_client(cls, dp: DifferentialPrivacy, clients_per_round: int,
                   seed: int = 0, rounding: float = 0.0) -> "DPHooks":
        """The hooks a board needs in distributed mode (clip, noise share): no accountant,
        so no dp-accounting on the board."""
        return cls(dp, clients_per_round, clients_per_round, seed, server=False,
                   rounding=rounding)

    @staticmethod
    def rounding_of(secure, clients_per_round: int) -> float:
        """The largest change the secure quantiser makes to one value of a DP round's
        contribution: one level (`secagg.Quantiser.unit`) of the ring for
        clients_per_round participants of weight 1 (DP rounds weigh every client 1, and a
        round has at most that many participants, so its own level is no larger)."""
        from .secagg import Quantiser

        return Quantiser.for_round(secure.ring_bits, secure.clip_range, clients_per_round,
                                   1).unit

    def clip_bound(self, size: int) -> float:
        """The L2 norm a delta of `size` values is clipped to: the round's C, less the
        secure quantiser's worst rounding (each value moves by under one level, so the
        quantised vector that enters the sum is within sqrt(size) levels of the clipped
        one), so that the vector summed, not only the float one, is within C. ValueError
        naming the keys when the rounding alone could pass C."""
        room = math.sqrt(size) * self.rounding
        if room >= self.clip:
            raise ValueError(
                f"privacy.dp.clip = {self.clip:g} leaves no room for the secure quantiser's "
                f"rounding: {size} values each moved by up to one level ({self.rounding:.3g}) "
                f"can move the norm by {room:.3g}; raise privacy.dp.clip, narrow "
                f"privacy.secure_aggregation.clip_range or use ring_bits: 64")
        return self.clip - room

    def client_settings(self) -> dict:
        """What a board needs to run `client_delta` when it, not the aggregator, must clip
        (under secure aggregation the aggregator sees only the sum): the round's
        announcement carries this, and `from_client_settings` reads it back."""
        return {"mode": self.dp.mode, "clip": self.clip,
                "noise_multiplier": self.dp.noise_multiplier,
                "reproducible": self.dp.reproducible,
                "clients_per_round": self.clients_per_round, "rounding": self.rounding}

    @classmethod
    def from_client_settings(cls, doc: Mapping) -> "DPHooks":
        """A board's hooks from an announcement's `dp` object; ValueError naming the field
        when it is not one `client_settings` wrote."""
        try:
            mode, clip = doc["mode"], float(doc["clip"])
            z, m = float(doc["noise_multiplier"]), doc["clients_per_round"]
            # "rounding" is absent from an older aggregator's announcement: its boards
            # clipped to C itself, as this one then does
            reproducible, rounding = doc["reproducible"], float(doc.get("rounding", 0.0))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"announcement dp: missing or malformed field ({exc!r})") from None
        if mode not in ("central", "distributed"):
            raise ValueError(f"announcement dp.mode: {mode!r}")
        if not (clip > 0 and math.isfinite(clip)) or not (z >= 0 and math.isfinite(z)):
            raise ValueError(f"announcement dp: clip {clip!r}, noise_multiplier {z!r}")
        if not (rounding >= 0 and math.isfinite(rounding)):
            raise ValueError(f"announcement dp.rounding: {rounding!r}")
        if isinstance(m, bool) or not isinstance(m, int) or m < 1 \
                or not isinstance(reproducible, bool):
            raise ValueError(f"announcement dp: clients_per_round {m!r}, reproducible "
                             f"{reproducible!r}")
        return cls.for_client(DifferentialPrivacy(mode=mode, clip=clip, noise_multiplier=z,
                                                  reproducible=reproducible), m,
                                rounding=rounding)

    # ------------------------------------------------------------------ client side
    def client_delta(self, delta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The delta clipped to the round's C (and, distributed, plus the client's share of
        the noise). `rng` is used only with privacy.dp.reproducible (it is seeded from the
        task); otherwise the share is drawn from a fresh CSPRNG-seeded generator."""
        clip = self.clip
        clipped, norm = clip_delta(delta, self.clip_bound(delta.size) if self.rounding
                                   else clip)
        with self._lock:
            self._bits[0] += norm <= clip
            self._bits[1] += 1
        std = self.mechanism.share_std(clip)
        if std == 0:
            return np.ascontiguousarray(clipped, dtype=np.float32)
        if self.seed is None:
            rng = noise_generator(None, 0, 0)
        return add_gaussian(clipped, std, rng)

    # ------------------------------------------------------------------ server side
    def before_round(self, round: int) -> None:
        """BudgetExhausted when round `round` would take epsilon past the target: epsilon
        after a round depends only on its number, so the run ends before the round opens
        and no board trains for a round that could not be released."""
        if self.accountant is None:
            raise RuntimeError("DPHooks.for_client hooks have no server side")
        epsilon = self.accountant.epsilon(round)
        target = self.dp.target_epsilon
        if target is not None and epsilon > target:
            raise BudgetExhausted(
                f"privacy budget: this round would bring epsilon to {epsilon:.4g} "
                f"(delta {self.dp.delta:g}), past privacy.dp.target_epsilon = {target:g}; "
                f"the run ends with round {round - 1}'s model at epsilon "
                f"{self.accountant.epsilon(round - 1):.4g}")

    def server_sum(self, total, round: int):
        """The sum to step with: the budget check again (`before_round`; a guard for a
        caller that did not ask), the noise, the fixed denominator m, and the next clip."""
        self.before_round(round)
        epsilon = self.accountant.epsilon(round)
        if total.weight != total.count:
            raise StrategyError(   # refused before round 1 by the config; a guard here
                f"round {round}: the sum's weights total {total.weight:g} for {total.count} "
                f"clients; DP needs each client's weight to be 1 (strategy.weighting: "
                f"uniform)")
        clip = self.clip
        with self._lock:
            within, seen = self._bits
            self._bits = [0, 0]
        rng = noise_generator(self.seed, round, AGGREGATOR)
        std = self.mechanism.server_std(clip, total.count)
        vector = add_gaussian(total.vector, std, rng) if std > 0 else total.vector
        metrics = {"dp_epsilon": epsilon, "dp_delta": self.dp.delta, "dp_clip": clip,
                   "dp_noise_std": self.mechanism.sum_noise_std(clip),
                   "dp_participants": total.count}
        if self.dp.mode == "distributed":
            metrics["dp_noise_shortfall"] = max(0, self.clients_per_round - total.count)
        if self.dp.adaptive_clip is not None:
            centred = (within - seen / 2) + float(rng.normal(0.0, self.mechanism.count_noise)) \
                if self.mechanism.count_noise > 0 else float(within - seen / 2)
            self.clip = self.mechanism.next_clip(clip, centred)
            metrics["dp_unclipped_fraction"] = centred / self.clients_per_round + 0.5
            metrics["dp_next_clip"] = self.clip
        self._metrics = {round: metrics}
        # the fixed denominator: the strategy divides the sum by m, not by who came up
        return total.replace(vector=vector, weight=float(self.clients_per_round))

    def round_metrics(self, round: int) -> Mapping:
        return dict(self._metrics.get(round, {}))

    # ------------------------------------------------------------------ a resumed run
    def resume(self, history: Sequence[Mapping]) -> None:
        """Take the clip up where a run's records left it (an aggregator resumed from its
        checkpoint): the last record's dp_next_clip, when the clip adapts."""
        for record in reversed(list(history)):
            if record.get("dp_next_clip") is not None:
                self.clip = float(record["dp_next_clip"])
                return
