"""Seeded cohort sampling whose RNG state survives checkpoints as JSON."""

from __future__ import annotations

from typing import Sequence

import numpy as np


class CohortSampler:
    """Samples M agents uniformly without replacement from the live ones."""

    def __init__(self, seed: int):
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def sample(self, live_ids: Sequence[str], size: int) -> list[str]:
        """``size`` distinct ids from ``live_ids``, which are sorted (all of them if there are fewer). Draws ``size``
        positions (numpy's Floyd sampling when the cohort is small beside the population) and reads only those: a
        cohort costs O(cohort), not a pass over the population."""
        if size >= len(live_ids):
            return list(live_ids)
        picked = self._rng.choice(len(live_ids), size=size, replace=False)
        return [live_ids[int(i)] for i in sorted(picked)]

    def state(self) -> dict:
        """The RNG state as JSON-able data."""
        return self._rng.bit_generator.state

    def load_state(self, state: dict) -> None:
        """Restore an RNG state saved by :meth:`state`."""
        if not isinstance(state, dict) or state.get("bit_generator") != "PCG64":
            raise ValueError("sampler state must be a PCG64 state dict")
        self._rng.bit_generator.state = state
