"""t-of-n Shamir secret sharing of 32-byte secrets over the prime field GF(2^521 - 1).

A share is (x, y) with x in 1..n (the holder's index) and y a field element stored as 66 big-endian
bytes. Any t shares give the secret by Lagrange interpolation at 0; fewer reveal nothing about it.
"""

from __future__ import annotations

import secrets
from typing import Iterable, Sequence

from fedpar.secagg.errors import SecAggAbort, SecAggError

PRIME = (1 << 521) - 1  # a Mersenne prime, well above the 256-bit secrets
SECRET_BYTES = 32
SHARE_BYTES = 66  # ceil(521 / 8)


def split(secret: bytes, threshold: int, xs: Sequence[int]) -> dict[int, bytes]:
    """Shares of ``secret`` for holders ``xs``: any ``threshold`` of them reconstruct it."""
    if len(secret) != SECRET_BYTES:
        raise SecAggError(f"Shamir secrets are {SECRET_BYTES} bytes, got {len(secret)}")
    _check_xs(xs)
    if not 1 <= threshold <= len(xs):
        raise SecAggError(f"threshold {threshold} must be in 1..{len(xs)} (the number of holders)")
    coeffs = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    out = {}
    for x in xs:
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % PRIME
        out[x] = y.to_bytes(SHARE_BYTES, "big")
    return out


def combine(shares: dict[int, bytes], threshold: int) -> bytes:
    """The secret from at least ``threshold`` shares; one extra share, if given, is checked for consistency.

    Raises SecAggError for malformed shares and SecAggAbort when there are too few or they disagree.
    """
    _check_xs(shares)
    points = []
    for x, raw in shares.items():
        if len(raw) != SHARE_BYTES:
            raise SecAggError(f"a share is {SHARE_BYTES} bytes, got {len(raw)}")
        y = int.from_bytes(raw, "big")
        if y >= PRIME:
            raise SecAggError("share value is not a field element")
        points.append((x, y))
    if len(points) < threshold:
        raise SecAggAbort(f"only {len(points)} shares, {threshold} needed")
    points.sort()
    basis = points[:threshold]
    secret = _interpolate(basis, 0)
    if len(points) > threshold:  # an extra share must lie on the same polynomial
        x, y = points[threshold]
        if _interpolate(basis, x) != y:
            raise SecAggAbort("shares are inconsistent (some holder sent a wrong share)")
    if secret >= 1 << (8 * SECRET_BYTES):
        raise SecAggAbort("reconstructed value is not a 32-byte secret (inconsistent shares)")
    return secret.to_bytes(SECRET_BYTES, "big")


def _interpolate(points: list[tuple[int, int]], at: int) -> int:
    """Value at ``at`` of the polynomial through ``points`` (Lagrange)."""
    total = 0
    for j, (xj, yj) in enumerate(points):
        num = den = 1
        for m, (xm, _) in enumerate(points):
            if m != j:
                num = num * (at - xm) % PRIME
                den = den * (xj - xm) % PRIME
        total = (total + yj * num * pow(den, -1, PRIME)) % PRIME
    return total


def _check_xs(xs: Iterable[int]) -> None:
    xs = list(xs)
    if len(set(xs)) != len(xs):
        raise SecAggError("share indices must be distinct")
    for x in xs:
        if not isinstance(x, int) or not 1 <= x < 1 << 31:
            raise SecAggError(f"share index {x!r} must be an integer in 1..2^31-1")
