"""Picks each round's mode from the run's settings: plain, compressed (one object for the run) or secure (one per round)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from fedpar.protocol.codec import ModelLayout
from fedpar.server.compressed_round import CompressedRound
from fedpar.server.config import CoordinatorConfig
from fedpar.server.plain_round import PlainRound, RunUpdate
from fedpar.server.registry import AgentRegistry
from fedpar.server.secure_round import SecureRound, check_secure_setup, default_max_weight


class RoundModes:
    """The run's round modes; raises ValueError at once if the model or strategy cannot run them."""

    def __init__(self, config: CoordinatorConfig, names: Sequence[str], weights: Sequence[np.ndarray], strategy,
                 per_update: RunUpdate, in_thread: RunUpdate):
        if config.secure_aggregation:
            check_secure_setup(names, weights, strategy)
        self.config = config
        self.strategy = strategy
        self.in_thread = in_thread
        layout = ModelLayout.of_arrays(names, weights)
        self.run_mode = (CompressedRound(layout, config.upload_compression, strategy, per_update)
                         if config.upload_compression.method != "none" else PlainRound(layout, strategy, per_update))

    def for_round(self, round_id: int, cohort: list[str], registry: AgentRegistry,
                  weights: Sequence[np.ndarray]) -> PlainRound:
        """The mode of round ``round_id`` over ``cohort``, on top of the global ``weights``."""
        c = self.config
        if not c.secure_aggregation:
            return self.run_mode
        registered = [r.num_examples for r in map(registry.get, cohort) if r]
        max_weight = c.secagg_max_weight or default_max_weight(registered, c.local_epochs, len(cohort))
        return SecureRound(round_id, cohort, weights, c.secagg_clip, max_weight, c.secagg_stage_seconds,
                           self.strategy, self.in_thread)
