"""Differential privacy's parts on their own: the accountant against dp-accounting composed
independently here, clipping's bound, the noise's standard deviation, the noise split and
the adaptive clip's step, and the error when dp-accounting is missing."""
import math
import sys
from dataclasses import replace

import numpy as np
import pytest

dp_accounting = pytest.importorskip("dp_accounting")
from dp_accounting import pld, rdp  # noqa: E402

from edgefl.errors import ConfigError  # noqa: E402
from edgefl.privacy.accountant import PrivacyAccountant, noise_for_epsilon  # noqa: E402
from edgefl.privacy.dp import (DPMechanism, add_gaussian, clip_delta,  # noqa: E402
                               noise_generator)
from edgefl.privacy.settings import AdaptiveClip, DifferentialPrivacy  # noqa: E402


# ------------------------------------------------------------------ the accountant
@pytest.mark.parametrize("clients, per_round, sigma, rounds, kind", [
    (100, 10, 1.1, 60, "rdp"),      # q = 0.1
    (50, 20, 2.0, 25, "pld"),       # q = 0.4
    (30, 3, 0.8, 120, "rdp"),       # q = 0.1, little noise, many rounds
    (12, 12, 3.0, 40, "pld"),       # q = 1: no sampling
])
def test_epsilon_matches_dp_accounting_composed_here(clients, per_round, sigma, rounds, kind):
    delta = 1e-5
    q = per_round / clients
    # the expected value, built from dp-accounting's own events without edgefl's code
    gaussian = dp_accounting.GaussianDpEvent(sigma)
    one_round = gaussian if q == 1 else dp_accounting.PoissonSampledDpEvent(q, gaussian)
    reference = rdp.RdpAccountant() if kind == "rdp" else pld.PLDAccountant()
    reference.compose(dp_accounting.SelfComposedDpEvent(one_round, rounds))
    expected = reference.get_epsilon(delta)

    acc = PrivacyAccountant(DifferentialPrivacy(noise_multiplier=sigma, delta=delta,
                                                accountant=kind), clients, per_round)
    assert acc.epsilon(rounds) == pytest.approx(expected, rel=1e-9)
    # epsilon grows with the rounds and starts from nothing
    assert acc.epsilon(0) == 0 < acc.epsilon(1) < acc.epsilon(rounds // 2) < acc.epsilon(rounds)


def test_without_replacement_is_the_strict_replace_one_figure():
    acc = PrivacyAccountant(DifferentialPrivacy(noise_multiplier=1.0), 100, 10,
                            sampling="without_replacement")
    reference = rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    reference.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(100, 10,
                                                       dp_accounting.GaussianDpEvent(0.5)),
        30))
    assert acc.epsilon(30) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-9)
    poisson = PrivacyAccountant(DifferentialPrivacy(noise_multiplier=1.0), 100, 10)
    assert acc.epsilon(30) > poisson.epsilon(30)


def test_no_noise_is_infinite_epsilon():
    acc = PrivacyAccountant(DifferentialPrivacy(noise_multiplier=0.0), 10, 5)
    assert acc.epsilon(1) == math.inf


def test_rounds_within_budget_is_the_last_round_under_the_target():
    acc = PrivacyAccountant(DifferentialPrivacy(noise_multiplier=1.0), 100, 10)
    n = acc.rounds_within(3.0, 400)
    assert 0 < n < 400
    assert acc.epsilon(n) <= 3.0 < acc.epsilon(n + 1)
    assert acc.rounds_within(1e6, 50) == 50
    assert acc.rounds_within(1e-3, 50) == 0


def test_noise_for_epsilon_meets_the_target_tightly():
    dp = DifferentialPrivacy(delta=1e-5)
    z = noise_for_epsilon(2.0, dp, 100, 10, 50)
    acc = PrivacyAccountant(replace(dp, noise_multiplier=z), 100, 10)
    assert acc.epsilon(50) <= 2.0
    looser = PrivacyAccountant(replace(dp, noise_multiplier=z * 0.99), 100, 10)
    assert looser.epsilon(50) > 2.0


def test_missing_dp_accounting_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)   # import now raises ImportError
    with pytest.raises(ConfigError, match=r"privacy.dp: .*pip install 'edgefl\[privacy\]'"):
        PrivacyAccountant(DifferentialPrivacy(), 10, 5)


# ------------------------------------------------------------------ clipping
def test_clipping_bounds_each_contribution():
    rng = np.random.default_rng(0)
    base = [rng.normal(size=1000).astype(np.float32) * 0.01 for _ in range(5)]
    huge = (rng.normal(size=1000) * 1e4).astype(np.float32)
    clip = 0.7
    clipped = [clip_delta(d, clip)[0] for d in base]
    without = np.sum(clipped, axis=0, dtype=np.float64)
    with_huge = without + clip_delta(huge, clip)[0]
    assert np.linalg.norm(with_huge - without) <= clip
    out, norm = clip_delta(huge, clip)
    assert norm == pytest.approx(np.linalg.norm(huge.astype(np.float64)), rel=1e-6)
    assert np.linalg.norm(out.astype(np.float64)) <= clip
    assert np.linalg.norm(out.astype(np.float64)) == pytest.approx(clip, rel=1e-5)
    # a delta within the clip is the delta itself
    small = base[0]
    assert clip_delta(small, clip)[0] is small


def test_clipping_refuses_a_non_finite_delta():
    bad = np.ones(4, np.float32)
    bad[2] = np.nan
    with pytest.raises(ValueError, match="not finite"):
        clip_delta(bad, 1.0)


# ------------------------------------------------------------------ noise
def test_noise_has_the_stated_std():
    std = 0.37
    x = np.zeros(200_000, np.float32)
    noisy = add_gaussian(x, std, noise_generator(11, 3, 0))
    # the sample std of 200k normal draws is within 1% of the true one (its own relative
    # std is 1/sqrt(2n) = 0.16%, so 1% is six of those)
    assert np.std(noisy.astype(np.float64)) == pytest.approx(std, rel=0.01)
    assert abs(np.mean(noisy.astype(np.float64))) < 5 * std / math.sqrt(x.size)


def test_reproducible_generator_is_reproducible_and_fresh_one_is_not():
    a = noise_generator(5, 2, 1).normal(size=4)
    assert np.array_equal(a, noise_generator(5, 2, 1).normal(size=4))
    assert not np.array_equal(a, noise_generator(5, 2, 2).normal(size=4))
    assert not np.array_equal(a, noise_generator(5, 3, 1).normal(size=4))
    assert not np.array_equal(noise_generator(None, 2, 1).normal(size=4),
                              noise_generator(None, 2, 1).normal(size=4))


def test_distributed_shares_add_up_to_the_central_std():
    m, clip = 8, 0.5
    dist = DPMechanism(DifferentialPrivacy(mode="distributed", clip=clip, noise_multiplier=1.3), m)
    central = DPMechanism(DifferentialPrivacy(clip=clip, noise_multiplier=1.3), m)
    assert central.server_std(clip, m) == pytest.approx(1.3 * clip)
    assert central.share_std(clip) == 0
    assert dist.share_std(clip) * math.sqrt(m) == pytest.approx(1.3 * clip)
    assert dist.server_std(clip, m) == 0
    # with 3 of 8 shares missing the aggregator tops the sum up to the full variance
    top = dist.server_std(clip, 5)
    assert 5 * dist.share_std(clip) ** 2 + top ** 2 == pytest.approx((1.3 * clip) ** 2)
    # and the sum of m shares drawn with fixed seeds has the full std
    shares = sum(add_gaussian(np.zeros(100_000, np.float32), dist.share_std(clip),
                              noise_generator(1, 1, c)).astype(np.float64) for c in range(m))
    assert np.std(shares) == pytest.approx(1.3 * clip, rel=0.015)


# ------------------------------------------------------------------ adaptive clipping
def test_noise_split_is_the_papers():
    dp = DifferentialPrivacy(noise_multiplier=1.0, adaptive_clip=AdaptiveClip(count_noise=5.0))
    mech = DPMechanism(dp, 100)
    sd = mech.delta_noise_multiplier
    # the two queries (deltas with sd, centred bits of sensitivity 1/2 with sigma_b) compose
    # to a Gaussian with multiplier z: z^-2 = sd^-2 + (2 sigma_b)^-2
    assert sd ** -2 + (2 * 5.0) ** -2 == pytest.approx(1.0)
    assert sd > 1.0
    assert DPMechanism(replace(dp, adaptive_clip=AdaptiveClip()), 100).count_noise == 5.0


def test_count_noise_too_small_names_the_key():
    dp = DifferentialPrivacy(noise_multiplier=1.0, adaptive_clip=AdaptiveClip())
    with pytest.raises(ConfigError, match=r"privacy.dp.adaptive_clip.count_noise: 0.5 "):
        DPMechanism(dp, 10)


def test_adaptive_clip_moves_toward_the_quantile():
    # noiseless count (noise_multiplier 0) to see the update rule itself
    mech = DPMechanism(DifferentialPrivacy(noise_multiplier=0.0,
                                           adaptive_clip=AdaptiveClip(target_quantile=0.5,
                                                                      lr=0.2, count_noise=0)),
                       20)
    rng = np.random.default_rng(4)
    norms = rng.lognormal(mean=0.0, sigma=0.5, size=(60, 20))   # median 1.0
    for start in (0.05, 30.0):
        clip = start
        for round_norms in norms:
            centred = float(np.sum((round_norms <= clip) - 0.5))
            clip = mech.next_clip(clip, centred)
        assert clip == pytest.approx(1.0, rel=0.35), start
    # one step: all within the clip -> C shrinks by exp(-lr * (1 - q))
    assert mech.next_clip(2.0, 10.0) == pytest.approx(2.0 * math.exp(-0.2 * 0.5))


# ------------------------------------------------------------------ distributed shares
def test_distributed_shares_through_the_hooks_give_the_sum_the_full_std():
    """m clients' hooks each clip and add a share; the aggregator's hook adds nothing when
    all m arrive and tops up to the full variance when some are missing."""
    from edgefl.privacy.dp import DPHooks
    from edgefl.strategies import SumTotal

    m, clip, z, n = 6, 0.5, 1.2, 60_000
    dp = DifferentialPrivacy(mode="distributed", clip=clip, noise_multiplier=z,
                             reproducible=True)
    server = DPHooks(dp, 12, m, seed=3)
    board = DPHooks.for_client(dp, m)
    assert board.accountant is None
    shares = [board.client_delta(np.zeros(n, np.float32), noise_generator(3, 1, c))
              for c in range(m)]
    for share in shares:   # each share alone has std z C / sqrt(m)
        assert np.std(share.astype(np.float64)) == pytest.approx(z * clip / math.sqrt(m),
                                                                 rel=0.02)
    full = np.sum([s.astype(np.float64) for s in shares], axis=0).astype(np.float32)
    out = server.server_sum(SumTotal(full, m, {}, m), 1)
    assert np.array_equal(out.vector, full)                   # nothing added
    assert np.std(out.vector.astype(np.float64)) == pytest.approx(z * clip, rel=0.02)
    assert server.round_metrics(1)["dp_noise_shortfall"] == 0
    short = np.sum([s.astype(np.float64) for s in shares[:4]], axis=0).astype(np.float32)
    topped = server.server_sum(SumTotal(short, 4, {}, 4), 2)
    assert np.std(topped.vector.astype(np.float64)) == pytest.approx(z * clip, rel=0.02)
    assert server.round_metrics(2)["dp_noise_shortfall"] == 2
