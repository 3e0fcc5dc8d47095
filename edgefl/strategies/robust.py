"""Robust aggregation: the `robust` option FedAvg, FedProx, MFL and FedNova share, so a run
keeps learning when some clients upload garbage or attack (issue #7 item 4).

    strategy: {name: fedavg, robust: {rule: median, clip_norm: auto, max_norm_ratio: 10}}

The plain algorithms average what the clients upload, so one client that uploads a scaled or
sign-flipped model moves the global model wherever it likes. With `robust` set, the server
works on each client's *update* u_i = (w_i - w) / a_i, the change from the broadcast
buffer w (a_i = 1, except FedNova's normaliser ||a_i||_1), in three steps:

1. **screen** (`screen`): an update is rejected, with its client and the reason in the
   round metrics, when a buffer is missing or has the wrong size, holds a non-finite value,
   or (with `max_norm_ratio`) has a norm above max_norm_ratio x the round's median norm
   of that buffer. Rejected clients take no part in the round: not in the weights, not in
   FedNova's tau_eff, not in the train loss. When every update is rejected the round fails
   with a StrategyError naming each client and reason.
2. **clip** (`clip_factors`): with `clip_norm`, each accepted params update is scaled by
   s_i = min(1, clip_norm / ||u_i||) (update-norm clipping; "auto" uses the round's median
   norm, so it needs no tuning). MFL's momentum update is scaled by the same s_i as the
   client's params update: the upload is clipped as one.
3. **combine** (`combine`), per buffer, with the `rule`:
   - mean:         w + gain * sum_i p_i s_i u_i with the strategy's weights p_i
                   (renormalised over the accepted clients), written as a weighted sum of
                   the uploaded buffers and w with exact rational coefficients, so that with
                   nothing rejected or clipped it is the plain algorithm bit for bit;
   - median:       w + gain * coordinate-wise median of the s_i u_i (kernels.median);
   - trimmed_mean: w + gain * coordinate-wise mean after dropping the floor(trim * K)
                   largest and smallest values of each coordinate (kernels.trimmed_mean).
   gain is 1, except FedNova's tau_eff = sum_i p_i ||a_i||_1. Median and trimmed mean count
   every accepted client once (no sample weights: a client reports its own sample count).

Both robust rules stream over the K separate update buffers in C; nothing is stacked.

Parameters (`robust:`, a mapping, or just a rule name: `robust: median`):

    rule            mean | median | trimmed_mean          (default mean)
    trim            fraction trimmed from each end, [0, 0.5); trimmed_mean only (default 0.2)
    clip_norm       null | a number > 0 | auto             (default null: no clipping)
    max_norm_ratio  null | a number >= 1                   (default null: no norm rejection)

Non-finite and malformed updates are always rejected once `robust` is set. Unset (the
default, null), each strategy runs exactly as before: same code path, same bits, and
`hyperparameters()` does not mention it (strategies.extension_field).

References: coordinate-wise median and trimmed mean, Yin, Chen, Ramchandran, Bartlett,
"Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates", ICML 2018;
update-norm clipping, Sun, Kairouz, Suresh, McMahan, "Can You Really Backdoor Federated
Learning?", 2019.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Mapping, Sequence

import numpy as np

from .. import kernels
from . import StrategyError, Update, check_choice, check_number, exact_weights, weighted_average

# shared code of fedavg, mfl and fednova, not an algorithm: strategy discovery
# (strategies._load_builtin) imports this module but expects no @register in it
HELPER = True

__all__ = ["RULES", "ROBUST_DEFAULTS", "robust_params", "Screening", "screen", "clip_factors",
           "combine", "aggregate_robustly", "rejected_summary"]

RULES = ("mean", "median", "trimmed_mean")
ROBUST_DEFAULTS = {"rule": "mean", "trim": 0.2, "clip_norm": None, "max_norm_ratio": None}


# ---------------------------------------------------------------------------------------
# the parameter
# ---------------------------------------------------------------------------------------

def robust_params(strategy: str, value) -> dict | None:
    """The validated `robust` parameter of `strategy` with every key filled in (a plain dict
    of JSON values, so it crosses the wire and the checkpoint unchanged), or None.
    Errors name the key: "strategy 'fedavg': robust.trim = 0.5 must be ..."."""
    if value is None:
        return None
    if isinstance(value, str):
        value = {"rule": value}
    if not isinstance(value, Mapping):
        raise StrategyError(f"strategy {strategy!r}: robust = {value!r} must be a mapping of "
                            f"{', '.join(ROBUST_DEFAULTS)} (or a rule name: "
                            f"{', '.join(RULES)})")
    for key in value:
        if key not in ROBUST_DEFAULTS:
            raise StrategyError(f"strategy {strategy!r}: robust.{key} = {value[key]!r}: unknown "
                                f"key; valid: {', '.join(ROBUST_DEFAULTS)}")
    out = {**ROBUST_DEFAULTS, **value}
    for key in ("trim", "clip_norm", "max_norm_ratio"):   # YAML 1.1 reads 1e3 as a string
        if isinstance(out[key], str) and out[key] != "auto":
            try:
                out[key] = float(out[key])
            except ValueError:
                pass                                        # reported below, naming the key
    check_choice(strategy, "robust.rule", out["rule"], RULES)
    check_number(strategy, "robust.trim", out["trim"], 0.0, 0.5, hi_open=True,
                 why="the fraction of the values dropped at each end of every coordinate; "
                     "0.5 would drop them all")
    out["trim"] = float(out["trim"])
    clip = out["clip_norm"]
    if clip is not None and clip != "auto":
        check_number(strategy, "robust.clip_norm", clip, 0.0, math.inf, lo_open=True,
                     hi_open=True, why="the largest update norm kept, or 'auto' for the "
                                       "round's median norm, or null for no clipping")
        out["clip_norm"] = float(clip)
    ratio = out["max_norm_ratio"]
    if ratio is not None:
        check_number(strategy, "robust.max_norm_ratio", ratio, 1.0, math.inf, hi_open=True,
                     why="updates with a norm above this many times the round's median norm "
                         "are rejected; null turns the check off")
        out["max_norm_ratio"] = float(ratio)
    return out


# ---------------------------------------------------------------------------------------
# 1. screening
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Screening:
    """accepted: sorted client ids; rejected: {client: reason}; norms: {buffer name: {client:
    ||u_i||}} of the accepted clients (the normalised update norms)."""
    accepted: tuple
    rejected: Mapping[int, str]
    norms: Mapping[str, Mapping[int, float]]


def screen(strategy: str, round: int, updates: Mapping[int, Update],
           base: Mapping[str, np.ndarray], robust: Mapping,
           divisors: Mapping[int, object] | None = None,
           refusals: Mapping[int, str] | None = None) -> Screening:
    """Check every update's buffers `base` names against the broadcast buffers; reject the
    malformed, the non-finite and (with max_norm_ratio) the too large. `divisors`: each
    client's update normaliser a_i (FedNova), which must be a finite number > 0.
    `refusals`: {client: reason} the strategy's own checks found (FedNova: an a_i its steps
    do not give), rejected with the rest."""
    reasons: dict = {}
    norms = {name: {} for name in base}
    scratch = np.empty_like(next(iter(base.values())))
    for c in sorted(updates):
        why = [refusals[c]] if refusals and c in refusals else []
        divisor = 1.0
        if divisors is not None:
            divisor = divisors.get(c)
            if isinstance(divisor, bool) or not isinstance(divisor, (int, float)) \
                    or not math.isfinite(divisor) or divisor <= 0:
                why.append(f"normaliser {divisor!r} is not a finite number > 0")
                divisor = None
        for name, ref in base.items():
            buf = updates[c].buffers.get(name)
            if buf is None:
                why.append(f"no {name!r} buffer (got {sorted(updates[c].buffers)})")
                continue
            if buf.size != ref.size:
                why.append(f"{name!r} has {buf.size} values, the model {ref.size}")
                continue
            bad = buf.size - int(np.count_nonzero(np.isfinite(buf)))
            if bad:
                why.append(f"{bad} non-finite value(s) in {name!r}")
                continue
            with np.errstate(over="ignore"):      # a huge value minus w may overflow: caught below
                np.subtract(buf, ref, out=scratch)
            norm = math.sqrt(kernels.sqnorm(scratch))
            if not math.isfinite(norm):
                why.append(f"{name!r} update overflows float32 (values near the float32 limit)")
                continue
            if divisor is not None:
                norms[name][c] = norm / divisor
        if why:
            reasons[c] = "; ".join(why)
    for name in base:
        for c in reasons:
            norms[name].pop(c, None)
    ratio = robust["max_norm_ratio"]
    if ratio is not None:
        too_large: dict = {}
        for name in base:
            if not norms[name]:
                continue
            median = float(np.median(list(norms[name].values())))
            if median <= 0:      # most clients did not move: nothing to compare against
                continue
            for c, norm in norms[name].items():
                if norm > ratio * median:
                    too_large.setdefault(c, []).append(
                        f"{name!r} update norm {norm:.4g} is {norm / median:.1f}x the round's "
                        f"median {median:.4g} (max_norm_ratio {ratio:g})")
        for c, why in too_large.items():
            reasons[c] = "; ".join(why)
            for name in base:
                norms[name].pop(c, None)
    accepted = tuple(c for c in sorted(updates) if c not in reasons)
    if not accepted:
        listed = "; ".join(f"client {c}: {why}" for c, why in sorted(reasons.items()))
        raise StrategyError(f"{strategy}: round {round}: every update was rejected ({listed})")
    return Screening(accepted, dict(sorted(reasons.items())), norms)


# ---------------------------------------------------------------------------------------
# 2. clipping
# ---------------------------------------------------------------------------------------

def clip_factors(robust: Mapping, norms: Mapping[int, float]) -> dict:
    """{client: s_i}, s_i = min(1, bound / ||u_i||); bound = clip_norm, or the median of
    `norms` for "auto"; every s_i = 1 without clip_norm."""
    clip = robust["clip_norm"]
    if clip is None or not norms:
        return {c: 1.0 for c in norms}
    bound = float(np.median(list(norms.values()))) if clip == "auto" else float(clip)
    return {c: 1.0 if norm <= bound else bound / norm for c, norm in norms.items()}


# ---------------------------------------------------------------------------------------
# 3. combining
# ---------------------------------------------------------------------------------------

def combine(robust: Mapping, base: np.ndarray, buffers: Mapping[int, np.ndarray],
            weights: Mapping[int, Fraction], scales: Mapping[int, float],
            divisors: Mapping[int, Fraction] | None = None, gain: Fraction = Fraction(1)):
    """A new buffer w + gain * rule_i(s_i (buffers[i] - w) / a_i) over the clients of
    `buffers` in sorted order (module docstring, step 3)."""
    clients = sorted(buffers)
    a = {c: Fraction(1) for c in clients} if divisors is None else divisors
    if robust["rule"] == "mean":
        # sum_i c_i w_i + (1 - sum_i c_i) w: exact coefficients, one rounding each, and the
        # base drops out when they sum to exactly 1 (nothing clipped: the plain algorithm).
        coeffs = [weights[c] * gain * Fraction(scales[c]) / a[c] for c in clients]
        residual = 1 - sum(coeffs)
        parts = [buffers[c] for c in clients]
        factors = [float(x) for x in coeffs]
        if residual != 0:
            parts.append(base)
            factors.append(float(residual))
        return weighted_average(parts, factors)
    updates = []
    for c in clients:
        u = np.subtract(buffers[c], base, dtype=np.float32)
        factor = scales[c] / float(a[c])
        if factor != 1.0:
            kernels.scale(u, factor)
        updates.append(u)
    middle = np.empty_like(base)
    if robust["rule"] == "median":
        kernels.median(middle, updates)
    else:
        trim = min(int(math.floor(robust["trim"] * len(updates) + 1e-9)), (len(updates) - 1) // 2)
        kernels.trimmed_mean(middle, updates, trim)
    return weighted_average([base, middle], [1.0, float(gain)])


# ---------------------------------------------------------------------------------------
# the whole server step, as the strategies call it
# ---------------------------------------------------------------------------------------

def aggregate_robustly(strategy: str, round: int, updates: Mapping[int, Update],
                       base: Mapping[str, np.ndarray], robust: Mapping, weighting: str,
                       normalisers: Mapping[int, object] | None = None,
                       refusals: Mapping[int, str] | None = None):
    """(new buffers {name: buffer} for every name in `base`, the accepted updates, metrics).

    base: the broadcast buffers the updates are measured from ("params", and MFL's
    "momentum"); the clip factors come from the "params" norms. normalisers: FedNova's
    ||a_i||_1 per client: updates are divided by it and the result multiplied by
    tau_eff = sum_i p_i ||a_i||_1 over the accepted clients (also in the metrics).

    metrics: robust_rejected (sorted ids), robust_reasons ({"id": reason}: string keys, as
    they are in metrics.jsonl and the checkpoint), robust_clipped (sorted ids whose update
    was scaled down), and tau_eff with normalisers."""
    screening = screen(strategy, round, updates, base, robust, normalisers, refusals)
    accepted = {c: updates[c] for c in screening.accepted}
    clients, exact = exact_weights(accepted, weighting)
    weights = dict(zip(clients, exact))
    divisors, gain = None, Fraction(1)
    if normalisers is not None:
        divisors = {c: Fraction(normalisers[c]) for c in clients}
        gain = sum(weights[c] * divisors[c] for c in clients)
    scales = clip_factors(robust, screening.norms["params"])
    new = {name: combine(robust, ref, {c: accepted[c].buffers[name] for c in clients}, weights,
                         scales, divisors, gain)
           for name, ref in base.items()}
    metrics = {"robust_rejected": sorted(screening.rejected),
               "robust_reasons": {str(c): why for c, why in screening.rejected.items()},
               "robust_clipped": sorted(c for c, s in scales.items() if s < 1.0)}
    if normalisers is not None:
        metrics["tau_eff"] = float(gain)
    return new, accepted, metrics


def rejected_summary(metrics: Mapping) -> Sequence[str]:
    """'client 3: reason' lines of a round's metrics (for logs)."""
    reasons = metrics.get("robust_reasons", {})
    return [f"client {c}: {reasons[c]}" for c in sorted(reasons, key=int)]
