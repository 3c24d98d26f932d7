"""How long a client waits before it tries an unreachable (or busy) coordinator again: jittered exponential
backoff, and the defaults every client of the coordinator shares (agents and simulation hosts, client/links.py).

The cap is low because a restarted coordinator starts its first round once ``--min-available`` agents are back:
an agent that has waited through a long outage tries again within MAX_BACKOFF_SECONDS of the coordinator's return
(issue 33's target: restart to the first completed round within 8 s). At that cap a down coordinator is dialled
about once every 2.5-5 s per agent, jittered so that agents do not come back in lockstep.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Protocol

FIRST_BACKOFF_SECONDS = 0.5  # the first wait; it doubles after each failed try
MAX_BACKOFF_SECONDS = 5.0  # the longest wait between two tries (`fedpar client --max-backoff`)


class Uniform(Protocol):
    """A source of uniform draws in [0, 1): random.Random or a numpy Generator."""

    def random(self) -> float:
        """One draw."""


def jittered(step: float, rng: Uniform) -> float:
    """``step`` times a uniform factor in [0.5, 1.5), so that agents retrying together spread out."""
    return step * (0.5 + rng.random())


def sleep_unless(seconds: float, stopped: Callable[[], bool], every: float = 0.25) -> None:
    """Sleep ``seconds``, or less once ``stopped()`` (asked every ``every`` seconds): a stopped client leaves at once."""
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0 and not stopped():
        time.sleep(min(left, every))


class Backoff:
    """Exponential backoff: each wait is the current step, jittered but never above ``cap``; the step then doubles,
    up to ``cap``."""

    def __init__(self, first: float, cap: float, rng: Uniform):
        """Start at step ``first``; ``rng`` jitters the waits (each agent seeds its own)."""
        self.cap, self.rng = cap, rng
        self.step = first

    def wait(self, left: float | None = None) -> float:
        """Seconds to wait before the next try, at most ``cap`` and at most ``left`` (the time left to wait in all;
        None: no limit); the step doubles for the one after."""
        seconds = min(jittered(self.step, self.rng), self.cap, math.inf if left is None else max(left, 0.0))
        self.step = min(self.step * 2, self.cap)
        return seconds

    def fits_before(self, deadline_at: float) -> bool:
        """Whether a wait of the current step still ends before ``deadline_at`` (a time.monotonic() value)."""
        return time.monotonic() + self.step < deadline_at


class Pacer:
    """Paces a loop whose turns a peer may answer at once with nothing to do (a coordinator that ends every long-poll
    at once, or hands out only tasks the client refuses): after such a turn, one shorter than ``fast`` seconds, the
    next waits a jittered backoff from ``first`` up to ``cap`` seconds; a turn that did something, or took longer,
    starts it over."""

    def __init__(self, first: float, cap: float, rng: Uniform, fast: float):
        self.first, self.cap, self.rng, self.fast = first, cap, rng, fast
        self._backoff: Backoff | None = None

    def after(self, started: float, idle: bool) -> float:
        """Seconds to wait before the next turn (0: at once), after one begun at ``started`` (time.monotonic())."""
        if not idle or time.monotonic() - started >= self.fast:
            self._backoff = None
            return 0.0
        self._backoff = self._backoff or Backoff(self.first, self.cap, self.rng)
        return self._backoff.wait()
