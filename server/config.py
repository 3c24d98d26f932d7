"""Coordinator settings, as one dataclass."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from fedpar.aggregation.compression import CompressionConfig
from fedpar.protocol.messages import DEFAULT_CHUNK_BYTES


@dataclass
class CoordinatorConfig:
    """Everything that shapes the coordinator's rounds and its limits."""

    rounds: int = 10
    clients_per_round: int = 10  # K: updates that close a round early
    fraction: float | None = None  # if set, K = max(min_reports, round(fraction * live agents))
    min_available: int = 2  # live agents needed before a round starts
    min_reports: int = 1  # fewer accepted updates than this and the round fails, global unchanged
    overselect: float = 1.3  # sample M = ceil(K * overselect) agents (FedScale's over-commitment)
    deadline_seconds: float = 60.0  # straggler deadline, from task dispatch
    local_epochs: int = 1
    batch_size: int = 32
    learning_rate: float = 0.05
    seed: int = 0
    heartbeat_seconds: float = 5.0
    liveness_timeout_seconds: float = 20.0  # no call for this long: the agent is not sampled
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_model_bytes: int = 8 << 30
    max_concurrent_uploads: int = 4  # each in-flight upload stages one model copy
    wait_for_agents_seconds: float | None = None  # None: wait forever for min_available agents
    checkpoint_dir: Path | None = None
    metrics_path: Path | None = None
    client_config: dict[str, float | int | str | bool] = field(default_factory=dict)
    upload_compression: CompressionConfig = field(default_factory=CompressionConfig)  # agents compress their deltas

    def validate(self) -> None:
        """Raise ValueError naming the setting to change when settings are inconsistent."""
        checks = [
            (self.rounds >= 0, "rounds must be >= 0"),
            (self.clients_per_round >= 1, "clients_per_round must be >= 1"),
            (self.fraction is None or 0 < self.fraction <= 1, "fraction must be in (0, 1]"),
            (self.min_reports >= 1, "min_reports must be >= 1"),
            (self.min_available >= 1, "min_available must be >= 1"),
            (self.overselect >= 1.0, "overselect must be >= 1.0"),
            (self.deadline_seconds > 0, "deadline_seconds must be > 0"),
            (self.local_epochs >= 1 and self.batch_size >= 1, "local_epochs and batch_size must be >= 1"),
            (self.learning_rate > 0, "learning_rate must be > 0"),
            (self.max_chunk_bytes >= 1024, "max_chunk_bytes must be >= 1024"),
            (self.max_chunk_bytes <= 64 << 20, "max_chunk_bytes must be <= 64 MiB"),
            (self.max_concurrent_uploads >= 1, "max_concurrent_uploads must be >= 1"),
            (self.liveness_timeout_seconds > self.heartbeat_seconds,
             "liveness_timeout_seconds must exceed heartbeat_seconds"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.min_reports > self.clients_per_round and self.fraction is None:
            raise ValueError(f"min_reports ({self.min_reports}) cannot exceed clients_per_round "
                             f"({self.clients_per_round})")

    def target_reports(self, live: int) -> int:
        """K for a round with ``live`` agents available."""
        if self.fraction is not None:
            return max(self.min_reports, round(self.fraction * live))
        return self.clients_per_round

    def cohort_size(self, live: int) -> int:
        """M = ceil(K * overselect), capped at the number of live agents."""
        return min(live, math.ceil(self.target_reports(live) * self.overselect))
