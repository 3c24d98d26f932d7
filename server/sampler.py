"""Seeded cohort sampling whose RNG state survives checkpoints as JSON."""

from __future__ import annotations

from typing import Sequence

import numpy as np


class CohortSampler:
    """Samples M agents uniformly without replacement from the live ones."""

    def __init__(self, seed: int):
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def sample(self, live_ids: Sequence[str], size: int) -> list[str]:
        """``size`` distinct ids from ``live_ids`` (all of them if there are fewer)."""
        ids = sorted(live_ids)
        if size >= len(ids):
            return ids
        picked = self._rng.choice(len(ids), size=size, replace=False)
        return [ids[i] for i in sorted(picked)]

    def state(self) -> dict:
        """The RNG state as JSON-able data."""
        return self._rng.bit_generator.state

    def load_state(self, state: dict) -> None:
        """Restore an RNG state saved by :meth:`state`."""
        if not isinstance(state, dict) or state.get("bit_generator") != "PCG64":
            raise ValueError("sampler state must be a PCG64 state dict")
        self._rng.bit_generator.state = state
