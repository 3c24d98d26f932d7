"""The SecAgg+ communication graph (Bell et al. 2020): each client masks with and shares to k neighbours.

The graph is a Harary graph H(k, n) (every node joined to its k/2 nearest nodes on each side of a ring)
over the participants in a pseudorandom order derived from a public per-round seed. With k = n - 1 it is
the complete graph of the original SecAgg (Bonawitz et al. 2017).

Choice of k: ``default_neighbours(n) = 2 * ceil(2 * log2(n))`` (k = O(log n) as Bell et al. prove
sufficient), and the complete graph whenever that is >= n - 1 (n <= 19). So n=10 -> 9 (complete),
n=50 -> 24, n=1000 -> 40. Shares of a client's secrets are held by its neighbours and itself (k + 1
holders); the default threshold is an honest majority of them, ``floor((k + 1) / 2) + 1``.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from typing import Sequence

from fedpar.secagg.errors import SecAggError


def default_neighbours(n: int) -> int:
    """k for n participants: 2*ceil(2*log2 n), or n-1 (complete graph) when that is not smaller."""
    if n < 2:
        raise SecAggError("secure aggregation needs at least 2 participants")
    k = 2 * math.ceil(2 * math.log2(n))
    return n - 1 if k >= n - 1 else k


def default_threshold(k: int) -> int:
    """Shares needed to reconstruct a secret held by k neighbours + the owner: an honest majority."""
    return (k + 1) // 2 + 1


def check_neighbours(n: int, k: int) -> None:
    """Raise SecAggError unless k is n-1 (complete graph) or an even number in 2..n-2."""
    if k == n - 1 and n >= 2:
        return
    if not (2 <= k < n - 1 and k % 2 == 0):
        raise SecAggError(f"neighbours k={k} must be n-1={n - 1} (complete graph) or even and in 2..{n - 2}")


def harary_graph(participants: Sequence[str], k: int, seed: bytes) -> dict[str, frozenset[str]]:
    """Neighbour sets of the Harary graph H(k, n) over ``participants`` shuffled by ``seed``."""
    n = len(participants)
    if len(set(participants)) != n:
        raise SecAggError("participant ids must be distinct")
    check_neighbours(n, k)
    if k == n - 1:
        everyone = frozenset(participants)
        return {p: everyone - {p} for p in participants}
    ring = _ring(participants, seed)
    return {ring[i]: _around(ring, i, k // 2) for i in range(n)}


def harary_neighbours(participants: Sequence[str], k: int, seed: bytes, me: str) -> frozenset[str]:
    """``me``'s neighbour set in :func:`harary_graph` without building everyone's: n*k ids for a k as large as
    the round's settings may name (a client checks settings it did not choose)."""
    check_neighbours(len(participants), k)
    if k == len(participants) - 1:
        return frozenset(participants) - {me}
    ring = _ring(participants, seed)
    return _around(ring, ring.index(me), k // 2)


def _ring(participants: Sequence[str], seed: bytes) -> list[str]:
    return sorted(participants, key=lambda p: hmac.new(seed, p.encode(), hashlib.sha256).digest())


def _around(ring: list[str], i: int, half: int) -> frozenset[str]:
    n = len(ring)
    return frozenset(ring[(i + d) % n] for d in range(-half, half + 1) if d != 0)
