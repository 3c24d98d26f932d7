"""A cap on one update's share of a round's total weight (``--max-agent-share``), exact with a streaming sum.

With cap ``s``, the weights of a round's updates are clipped to ``min(w, L)``, where ``L`` is the one level at
which a clipped update holds exactly ``s`` of the clipped total (water-filling): no update then weighs more than
``s`` of the round, and updates below ``L`` keep their weights. At most ``ceil(1/s) - 1`` updates can be clipped,
and they are the heaviest, so :class:`ShareCap` holds back only that many (the heaviest so far) while every other
update is folded at once; when the round closes the held ones are folded with their clipped weights. With fewer
than ``1/s`` updates no weighting can keep each within ``s``: they then count equally, the nearest the cap allows.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import numpy as np

Update = tuple[Sequence[np.ndarray], float]


def clip_level(held: Sequence[float], rest_total: float, rest_max: float, rest_count: int, share: float) -> float:
    """The level ``L`` that the weights ``held`` (the heaviest of the round) are clipped to, given the other
    updates' total, largest weight and count; ``math.inf`` when no weight exceeds ``share`` of the total."""
    weights = sorted(held, reverse=True)
    # No weighting meets the cap: count every update equally. (ShareCap holds every update of such a round; the
    # product is not compared with 1, which rounds either way when 1 / share is a whole number: 49 * (1/49) < 1.)
    if not rest_count and len(weights) * share < 1:
        return weights[-1]
    total = sum(weights) + rest_total
    if not weights or weights[0] <= share * total:
        return math.inf
    below = total  # the weight of the updates that are not clipped
    for k in range(1, len(weights) + 1):
        below -= weights[k - 1]
        if 1 - k * share <= 0:
            break
        level = share * below / (1 - k * share)  # k clipped at L: L = share * (k * L + below)
        lighter = weights[k] if k < len(weights) else rest_max
        if lighter <= level:
            return level
    # Only rounding gets here: with n = 1/share updates every one must count equally, and the level, which is then
    # the lightest update's weight, came out an ulp below it (1 - 2 * (1/3) > 1/3).
    return rest_max if rest_count else weights[-1]


class ShareCap:
    """One round's heaviest updates, held back until it closes so their weights can be capped (thread-safe)."""

    def __init__(self, share: float):
        if not 0 < share <= 1:
            raise ValueError(f"the cap on one agent's share must be in (0, 1], got {share}")
        self.share = share
        self.slots = math.ceil(1 / share - 1e-12) - 1  # most updates that can weigh more than the cap
        self._held: list[Update] = []
        self._rest = (0.0, 0.0, 0)  # total, largest weight, count of the updates folded at once
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Updates held back so far."""
        return len(self._held)

    def offer(self, update: Sequence[np.ndarray], weight: float) -> Update | None:
        """Take one update; returns the update to fold now at its full weight (it or a lighter held one), if any."""
        with self._lock:
            if len(self._held) < self.slots:
                self._held.append((update, weight))
                return None
            lightest = min(range(len(self._held)), key=lambda i: self._held[i][1], default=None)
            out: Update = (update, weight)
            if lightest is not None and weight > self._held[lightest][1]:
                out, self._held[lightest] = self._held[lightest], out
            total, largest, count = self._rest
            self._rest = (total + out[1], max(largest, out[1]), count + 1)
            return out

    @property
    def rest(self) -> tuple[float, float, int]:
        """The total, largest weight and count of the updates folded at once."""
        with self._lock:
            return self._rest

    def merge_rest(self, total: float, largest: float, count: int) -> None:
        """Count updates folded at once elsewhere (another aggregator rank's) with those folded here."""
        with self._lock:
            t, m, c = self._rest
            self._rest = (t + total, max(m, largest), c + count)

    def held_updates(self) -> list[Update]:
        """The updates held back so far, with their full weights (they leave the cap)."""
        with self._lock:
            held, self._held = self._held, []
        return held

    def settle(self) -> list[Update]:
        """The held updates with their capped weights, to fold as the round closes."""
        with self._lock:
            held, self._held = self._held, []
            total, largest, count = self._rest
        if not held:
            return []
        level = clip_level([w for _, w in held], total, largest, count, self.share)
        return [(update, min(weight, level)) for update, weight in held]
