"""Verdicts on the papers' claims from runs paired by seed (tools/reproduce.py's statistics).

Every comparison pairs the two arms seed by seed (seed s of both arms shares the split, the
client draw and the initial model), takes the per-seed difference in the claimed direction
(the "gain": positive favours the claim) and decides from the 95% confidence interval of its
mean (Student's t on the paired differences, n - 1 degrees of freedom):

    holds                        the interval lies wholly on the claimed side of the margin
                                 (margin 0 unless the claim names one, e.g. "≥ 10 points")
    contradicted                 the interval lies wholly on the other side
    not resolved at this scale   the interval contains the margin (or n < 2)

A claim of equivalence ("within 0.5 points") holds when the interval lies inside
(-tol, +tol), is contradicted when it lies wholly outside, and is otherwise not resolved.

Rounds to a target can be censored: a run that never reaches the target within R rounds has
no value (None), and none is invented (never R + 1). The rule:

- both arms reached the target in every seed: the t interval above;
- neither arm reached it in any seed: not resolved, said as such;
- otherwise the sign of every seed's difference is still known where one arm reached it and
  the other did not (the one that reached it was faster), and where both did (ties carry no
  sign); seeds where neither did carry none. The verdict is then an exact sign test on those
  signs at the same level as the interval (one-sided p < 0.025 each way, i.e. two-sided 95%):
  it holds (or is contradicted) "by sign", with the counts shown. With every informative seed
  on one side the test needs at least 6 of them (1/2^5 = 0.031 > 0.025), so 5 seeds that all
  favour one arm are reported as such but "not resolved at this scale".
  No mean is given (a censored seed has no value), but the interval is: the 95%
  distribution-free interval of the median gain over the seeds with a sign, the dual of the
  sign test, so it excludes zero exactly when the test decides. A censored seed's gain is
  only bounded (a run that did not reach the target within its H rounds needs at least
  H + 1), and the interval is built from those bounds (the k-th smallest lower bound, the
  k-th largest upper bound), so it is valid whatever the censored values are.

A ratio of rounds (a speed-up) is formed only for seeds where both runs reached the target;
a speed-up comparison with a censored seed is not resolved and says how many seeds were
censored.

Each comparison is its own 95% interval; a check with several comparisons (targets, arms)
holds when all of them hold and is contradicted when any is, with no multiplicity
correction (said in the report).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

HOLDS = "holds"
CONTRADICTED = "contradicted"
UNRESOLVED = "not resolved at this scale"
VERDICTS = (HOLDS, CONTRADICTED, UNRESOLVED)
LEVEL = 0.95

# two-sided 95% critical values of Student's t (the 0.975 quantile), df = 1..30; beyond 30
# scipy when it is installed, else the df = 30 value (slightly wider: conservative)
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
         2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
         2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)


def t_critical(df: int) -> float:
    """The 0.975 quantile of Student's t with df degrees of freedom (a 95% two-sided
    interval)."""
    if df < 1:
        raise ValueError(f"t_critical: df = {df}, need at least 1")
    if df <= len(_T975):
        return _T975[df - 1]
    try:
        from scipy.stats import t
        return float(t.ppf(0.975, df))
    except ImportError:
        return _T975[-1]


@dataclass(frozen=True)
class Interval:
    """Mean and 95% t interval of a sample (n = 1: the interval is unbounded)."""
    mean: float
    lo: float
    hi: float
    n: int
    sd: float

    def text(self, fmt: str = "+.4f") -> str:
        if self.n < 2:
            return f"{self.mean:{fmt}} (one seed: no interval)"
        return f"{self.mean:{fmt}} [95% CI {self.lo:{fmt}}, {self.hi:{fmt}}]"


def t_interval(values) -> Interval:
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("t_interval: no values")
    if any(not math.isfinite(v) for v in vals):
        raise ValueError(f"t_interval: non-finite value in {vals}")
    n = len(vals)
    mean = sum(vals) / n
    if n < 2:
        return Interval(mean, -math.inf, math.inf, n, 0.0)
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
    half = t_critical(n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, sd)


def sign_test_p(k: int, n: int) -> float:
    """One-sided exact sign test: P(X >= k) for X ~ Binomial(n, 1/2)."""
    if not 0 <= k <= n:
        raise ValueError(f"sign_test_p: k = {k} outside 0..{n}")
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n


@dataclass
class Verdict:
    """One comparison's outcome. `interval` is of the gain (positive = the claimed
    direction) and is None when the verdict rests on signs (censoring) or on exact equality;
    `signs` then holds the counts."""
    verdict: str
    n: int
    interval: Interval | None = None
    margin: float = 0.0
    method: str = "t"            # t | sign | exact | equivalence | none
    signs: dict = field(default_factory=dict)
    note: str = ""
    # method "sign": the 95% interval of the median gain over the seeds with a sign (lo,
    # hi; infinite where a censored bound leaves that side open)
    median: tuple | None = None

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r}; valid: {VERDICTS}")


def judge(interval: Interval, margin: float = 0.0) -> str:
    """holds / contradicted / not resolved from a gain's interval against the margin."""
    if interval.n < 2:
        return UNRESOLVED
    if interval.lo > margin:
        return HOLDS
    if interval.hi < margin:
        return CONTRADICTED
    return UNRESOLVED


def _check_lengths(a, b, what):
    if len(a) != len(b):
        raise ValueError(f"{what}: {len(a)} values against {len(b)}; pair them by seed")
    if not a:
        raise ValueError(f"{what}: no seeds")


def median_rank(m: int) -> int:
    """k of the 95% interval of a median from m values, [k-th smallest, k-th largest]: the
    largest k with P(X <= k - 1) < 0.025 for X ~ Binomial(m, 1/2) (0: no interval)."""
    k = 0
    while k < m and sign_test_p(m - k, m) < 0.025:
        k += 1
    return k


def median_interval(bounds) -> tuple:
    """The 95% distribution-free interval of the median of values known only by bounds
    [(lo, hi), ...] (lo == hi for a known value): (k-th smallest lo, k-th largest hi), or
    (-inf, inf) when there are too few values for any."""
    k = median_rank(len(bounds))
    if k == 0:
        return (-math.inf, math.inf)
    return (sorted(lo for lo, _ in bounds)[k - 1], sorted(hi for _, hi in bounds)[-k])


def _censored_gain(a, b, ha, hb) -> tuple | None:
    """Bounds of the gain b - a (rounds saved by `better`) of one seed; a None value did not
    reach the target within its horizon (h rounds: it needs at least h + 1; without a
    horizon, at least one round more than the other arm). None: no sign (a tie, or neither
    reached)."""
    if a is None and b is None:
        return None
    if b is None:
        return ((hb + 1 - a) if hb is not None else 1, math.inf)
    if a is None:
        return (-math.inf, (b - ha - 1) if ha is not None else -1)
    return None if a == b else (b - a, b - a)


def paired(better, than, higher_is_better: bool, margin: float = 0.0,
           horizons: tuple | None = None) -> Verdict:
    """The claim "`better` beats `than`" (by more than `margin`) from per-seed values aligned
    by seed. None is a run that did not reach a target (only for lower-is-better rounds);
    `horizons`, a pair of per-seed round counts, bounds what such a run would have needed."""
    _check_lengths(better, than, "paired")
    censored = any(v is None for v in list(better) + list(than))
    if censored and higher_is_better:
        raise ValueError("paired: None (not reached) is only meaningful for a metric where "
                         "lower is better (rounds to a target)")
    n = len(better)
    if not censored:
        gains = [(a - b) if higher_is_better else (b - a) for a, b in zip(better, than)]
        iv = t_interval(gains)
        return Verdict(judge(iv, margin), n, iv, margin)
    if margin:
        raise ValueError("paired: a margin cannot be tested on censored values")
    signs = {"for": 0, "against": 0, "tie": 0, "neither": 0, "both": 0}
    for a, b in zip(better, than):
        if a is None and b is None:
            signs["neither"] += 1
        elif b is None:
            signs["for"] += 1
        elif a is None:
            signs["against"] += 1
        else:
            signs["both"] += 1
            signs["for" if a < b else "against" if a > b else "tie"] += 1
    reached_a = sum(v is not None for v in better)
    reached_b = sum(v is not None for v in than)
    signs.update(reached_better=reached_a, reached_than=reached_b)
    if reached_a == 0 and reached_b == 0:
        return Verdict(UNRESOLVED, n, None, method="none", signs=signs,
                       note="neither arm reached the target in any seed")
    m = signs["for"] + signs["against"]
    p_for = sign_test_p(signs["for"], m) if m else 1.0
    p_against = sign_test_p(signs["against"], m) if m else 1.0
    signs.update(p_for=p_for, p_against=p_against)
    verdict = HOLDS if p_for < 0.025 else CONTRADICTED if p_against < 0.025 else UNRESOLVED
    note = ""
    if verdict == UNRESOLVED and m and (signs["for"] == m or signs["against"] == m):
        note = f"all {m} informative seeds on one side; a sign test needs at least 6"
    ha, hb = horizons if horizons is not None else ([None] * n, [None] * n)
    _check_lengths(better, ha, "paired horizons")
    _check_lengths(than, hb, "paired horizons")
    bounds = [g for g in map(_censored_gain, better, than, ha, hb) if g is not None]
    return Verdict(verdict, n, None, method="sign", signs=signs, note=note,
                   median=median_interval(bounds))


def ratio_difference(num1, den1, num2, den2) -> Verdict:
    """The claim "the ratio num/den is larger in setting 1 than in setting 2" (e.g. a
    speed-up FedAvg rounds / FedUmf rounds), paired by seed; a seed with a censored member
    has no ratio."""
    for x in (den1, num2, den2):
        _check_lengths(num1, x, "ratio_difference")
    n = len(num1)
    diffs = []
    for a, b, c, d in zip(num1, den1, num2, den2):
        if None in (a, b, c, d):
            continue
        diffs.append(a / b - c / d)
    if len(diffs) < n:
        iv = t_interval(diffs) if diffs else None
        return Verdict(UNRESOLVED, n, iv, method="none",
                       note=f"{n - len(diffs)} of {n} seeds censored (a target not reached): "
                            f"no ratio is formed for them")
    iv = t_interval(diffs)
    return Verdict(judge(iv), n, iv)


def equivalent(a, b, tolerance: float) -> Verdict:
    """The claim "a and b are within `tolerance` of each other", paired by seed."""
    _check_lengths(a, b, "equivalent")
    if tolerance <= 0:
        raise ValueError(f"equivalent: tolerance {tolerance} must be > 0")
    iv = t_interval([x - y for x, y in zip(a, b)])
    if iv.n >= 2 and -tolerance < iv.lo and iv.hi < tolerance:
        verdict = HOLDS
    elif iv.n >= 2 and (iv.lo > tolerance or iv.hi < -tolerance):
        verdict = CONTRADICTED
    else:
        verdict = UNRESOLVED
    return Verdict(verdict, len(a), iv, margin=tolerance, method="equivalence")


def exactly_equal(a, b) -> Verdict:
    """A deterministic quantity (e.g. bytes sent) equal in every seed: no statistics."""
    _check_lengths(a, b, "exactly_equal")
    same = all(x == y for x, y in zip(a, b))
    return Verdict(HOLDS if same else CONTRADICTED, len(a), None, method="exact",
                   note="" if same else "differs in "
                   f"{sum(x != y for x, y in zip(a, b))} of {len(a)} seeds")


def combine(verdicts) -> str:
    """A check made of several comparisons: contradicted if any is, holds if all hold."""
    words = [v.verdict if isinstance(v, Verdict) else v for v in verdicts]
    if not words:
        return UNRESOLVED
    if CONTRADICTED in words:
        return CONTRADICTED
    if all(w == HOLDS for w in words):
        return HOLDS
    return UNRESOLVED


def _open_interval(bounds: tuple) -> str:
    """[lo, hi] of a median's 95% interval, an infinite side written as open."""
    lo, hi = bounds
    left = "(-∞" if lo == -math.inf else f"[{lo:+g}"
    right = "+∞)" if hi == math.inf else f"{hi:+g}]"
    return f"95% CI {left}, {right}"


def describe(v: Verdict, fmt: str = "+.4f", unit: str = "") -> str:
    """One line: the gain's mean and interval (or the sign counts), then the verdict."""
    if v.method == "exact":
        body = "equal in every seed" if v.verdict == HOLDS else v.note
        return f"{body} (exact, n = {v.n}) — {v.verdict}"
    if v.method in ("sign", "none") and v.signs:
        s = v.signs
        parts = [f"reached in {s['reached_better']}/{v.n} vs {s['reached_than']}/{v.n} seeds"]
        if v.method == "sign":
            parts.append(f"sign of the paired difference {s['for']} for, {s['against']} "
                         f"against, {s['tie'] + s['neither']} undecided; sign test "
                         f"p = {s['p_for']:.3f} for, {s['p_against']:.3f} against")
            if v.median is not None and s["for"] + s["against"]:
                parts.append(f"median gain over the {s['for'] + s['against']} seeds with a "
                             f"sign {_open_interval(v.median)}")
        if v.note:
            parts.append(v.note)
        return f"censored: {'; '.join(parts)} — {v.verdict}"
    text = v.interval.text(fmt) + unit if v.interval is not None else "no interval"
    if v.method == "equivalence":
        text = f"difference {text}, needs to lie within ±{v.margin:g}"
    else:
        text = f"gain {text}" + (f", needs > {v.margin:g}" if v.margin else "")
    text += f", n = {v.n}"
    if v.note:
        text += f"; {v.note}"
    return f"{text} — {v.verdict}"
