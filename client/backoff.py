"""Retrying calls to the coordinator: which failures are worth another try, and jittered exponential backoff.

Used by the client runtime (client/runtime.py, client/reconnect.py): it only decides how to wait.
"""

from __future__ import annotations

import time
from typing import Protocol

import grpc

# RESOURCE_EXHAUSTED: a coordinator limit (join rate, calls in flight); backing off is the cure.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED})


class Uniform(Protocol):
    """A source of uniform draws in [0, 1): random.Random or a numpy Generator."""

    def random(self) -> float:
        """One draw."""


def jittered(step: float, rng: Uniform) -> float:
    """``step`` times a uniform factor in [0.5, 1.5), so that agents retrying together spread out."""
    return step * (0.5 + rng.random())


class Backoff:
    """Exponential backoff: each wait is the current step, jittered; the step then doubles, up to ``cap``."""

    def __init__(self, first: float, cap: float, rng: Uniform):
        """Start at step ``first``; ``rng`` jitters the waits (each agent seeds its own)."""
        self.first, self.cap, self.rng = first, cap, rng
        self.step = first

    def wait(self) -> float:
        """Seconds to wait before the next try (the step doubles for the one after)."""
        seconds = jittered(self.step, self.rng)
        self.step = min(self.step * 2, self.cap)
        return seconds

    def reset(self) -> None:
        """Back to the first step (after a call that went through)."""
        self.step = self.first

    def fits_before(self, deadline_at: float) -> bool:
        """Whether a wait of the current step still ends before ``deadline_at`` (a time.monotonic() value)."""
        return time.monotonic() + self.step < deadline_at
