"""Shamir's t-of-n secret sharing over the prime field GF(2^521 - 1), for secure
aggregation's dropout recovery: a 32-byte secret (a self-mask seed, a mask private key) is the
constant term of a random polynomial of degree t - 1; holder x gets (x, f(x)); any t shares
give f(0) back by Lagrange interpolation, and t - 1 shares say nothing about it (every secret
is equally consistent with them).

This is arithmetic, not a cipher: the polynomial's coefficients come from the operating
system's generator (`secrets`), and the shares travel encrypted under keys from
`cryptography` (edgefl.privacy.secagg).
"""
from __future__ import annotations

import functools
import secrets
from typing import Mapping, Sequence

__all__ = ["PRIME", "SECRET_BYTES", "ShamirError", "split", "combine"]

PRIME = 2 ** 521 - 1          # a Mersenne prime, comfortably above any 32-byte secret
SECRET_BYTES = 32


class ShamirError(ValueError):
    """Shares that cannot give a secret back: too few, repeated or out of range."""


def split(secret: bytes, holders: Sequence[int], threshold: int) -> dict[int, int]:
    """{x: f(x)} for each holder x (distinct integers >= 1) of a fresh polynomial with
    f(0) = the secret (`SECRET_BYTES` bytes) and degree threshold - 1."""
    if len(secret) != SECRET_BYTES:
        raise ShamirError(f"secret of {len(secret)} bytes; shares carry {SECRET_BYTES}")
    xs = [int(x) for x in holders]
    if len(set(xs)) != len(xs) or any(not 0 < x < PRIME for x in xs):
        raise ShamirError(f"holders {xs[:10]}: need distinct x in 1..p-1")
    if not 1 <= threshold <= len(xs):
        raise ShamirError(f"threshold {threshold} for {len(xs)} holders: need 1..{len(xs)}")
    coeffs = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME)
                                                  for _ in range(threshold - 1)]
    out = {}
    highest_first = coeffs[::-1]
    for x in xs:
        # Horner, reduced once at the end: holders are small integers, so the unreduced value
        # grows by log2(x) bits a step (about 1000 bits for 100 holders), and one modulo of
        # that costs less than a modulo per step (half the time at 100 holders, t = 67).
        acc = 0
        for c in highest_first:
            acc = acc * x + c
        out[x] = acc % PRIME
    return out


def combine(shares: Mapping[int, int], threshold: int) -> bytes:
    """The secret from at least `threshold` shares {x: y} (the first `threshold` by x)."""
    if len(shares) < threshold:
        raise ShamirError(f"{len(shares)} shares, {threshold} needed")
    xs = tuple(sorted(int(x) for x in shares)[:threshold])
    if any(not 0 < x < PRIME for x in xs):
        raise ShamirError(f"share x out of range in {xs[:10]}")
    value = sum(shares[x] * lam for x, lam in zip(xs, _lagrange_at_zero(xs))) % PRIME
    if value >= 1 << (8 * SECRET_BYTES):
        raise ShamirError("the shares do not interpolate to a secret of 32 bytes (a wrong or "
                          "tampered share)")
    return value.to_bytes(SECRET_BYTES, "big")


@functools.lru_cache(maxsize=256)
def _lagrange_at_zero(xs: tuple) -> tuple:
    """The Lagrange basis at 0 for the points xs: prod_{m != j} x_m / (x_m - x_j). A round
    reconstructs many secrets from the same holders, so the basis is computed once."""
    out = []
    for j, xj in enumerate(xs):
        num = den = 1
        for m, xm in enumerate(xs):
            if m != j:
                num = num * xm % PRIME
                den = den * (xm - xj) % PRIME
        out.append(num * pow(den, -1, PRIME) % PRIME)
    return tuple(out)
