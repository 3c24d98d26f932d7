"""Coordinator settings, as one dataclass."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from fedpar.protocol.compressed_wire import CompressionConfig
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
    # Models up to this size (and one chunk) travel inside each task: one call less per agent and round; 0: never.
    # Every task reply of a round then carries a copy, so keep it small next to the number of agents.
    inline_weights_max_bytes: int = 64 << 10
    max_model_bytes: int = 8 << 30
    max_concurrent_uploads: int = 4  # each in-flight upload stages one model copy
    max_upload_chunks: int = 100_000  # chunks in one upload (tiny chunks cost CPU per message)
    max_calls_per_agent: int = 8  # one agent's calls in flight at once (long-poll, heartbeat, download, upload)
    max_upload_attempts_per_round: int = 4  # uploads an agent may start in one round (retries after breaks)
    max_upload_bytes_per_second: float | None = None  # per agent, after a one-model burst; None: unlimited
    max_agents: int = 100_000  # registered agents; Join of a new agent beyond this is refused
    upload_header_seconds: float = 2.0  # an UploadUpdate stream must send its header (and be authenticated) this fast
    upload_idle_seconds: float = 10.0  # a staged upload silent this long loses its staging slot
    upload_min_bytes_per_second: float = 32 << 10  # ... and so does one slower than this on average after that long
    max_unauthenticated_calls: int = 1024  # upload streams awaiting their header, in total (oldest let go beyond)
    max_unauthenticated_per_peer: int = 128  # ... and from one peer (certificate name, else address)
    max_examples_per_agent: int = 10_000_000  # largest example count a Join may declare (FedAvg weights by it)
    max_agent_share: float | None = None  # cap on one update's share of a round's total weight; None: no cap
    max_joins_per_second: float = 500.0  # server-wide Join rate (with a 5-second burst)
    max_concurrent_rpcs: int = 20_000  # server-wide calls in flight; long-polls count, so > agents
    max_queued_uploads: int = 64  # uploads holding or awaiting a staging slot; more are refused (agents retry)
    max_concurrent_downloads: int = 64  # weight streams sent at once; more wait their turn
    wait_for_agents_seconds: float | None = None  # None: wait forever for min_available agents
    checkpoint_dir: Path | None = None
    metrics_path: Path | None = None
    secure_aggregation: bool = False  # SecAgg+: the coordinator learns only the weighted mean update
    secagg_clip: float = 1.0  # each coordinate of an agent's update (local - global) is clipped to +-this
    secagg_max_weight: int | None = None  # cap on an agent's weight; None: largest registered examples x epochs
    secagg_stage_seconds: float = 30.0  # longest wait for each key-exchange stage and for unmasking
    data_plane: bool | None = None  # bulk socket transfers beside gRPC; None: on for models >= data_plane_min_bytes
    data_plane_min_bytes: int = 8 << 20
    data_port: int = 0  # port of the data plane on the gRPC host; 0: a free one
    data_plane_downloads: int = 8  # data-plane downloads served at once (uploads: max_concurrent_uploads)
    dataplane_handshake_seconds: float = 2.0  # TLS handshake, ticket (and upload header) must arrive this fast
    max_dataplane_handshakes: int = 256  # data-plane connections not yet authenticated, in total (oldest closed)
    max_dataplane_handshakes_per_peer: int = 64  # ... and from one address
    upload_compression: CompressionConfig = field(default_factory=CompressionConfig)  # agents compress their deltas
    aggregator_ranks: int = 1  # processes sharing one round's ingest and fold (server/aggregator_ranks.py)
    aggregator_timeout_seconds: float = 120.0  # longest wait for another aggregator rank in a collective
    accept_populations: bool = False  # simulations: hosts may register virtual populations (JoinPopulation)
    max_population_join: int = 10_000  # members in one JoinPopulation call
    # Simulations: the deadline and first-K act on simulated time (server/virtual_clock.py); hosts only.
    virtual_clock: bool = False
    round_wall_seconds: float = 600.0  # under the virtual clock: longest real time a round may take

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
            (self.inline_weights_max_bytes >= 0, "inline_weights_max_bytes must be >= 0"),
            (self.max_concurrent_uploads >= 1, "max_concurrent_uploads must be >= 1"),
            (self.max_upload_chunks >= 1 and self.max_calls_per_agent >= 1,
             "max_upload_chunks and max_calls_per_agent must be >= 1"),
            (self.max_upload_attempts_per_round >= 1, "max_upload_attempts_per_round must be >= 1"),
            (self.max_upload_bytes_per_second is None or self.max_upload_bytes_per_second > 0,
             "max_upload_bytes_per_second must be > 0"),
            (self.max_agents >= self.min_available, "max_agents must be >= min_available"),
            (self.max_examples_per_agent >= 1, "max_examples_per_agent must be >= 1"),
            (self.aggregator_ranks >= 1 and self.aggregator_timeout_seconds > 0,
             "aggregator_ranks must be >= 1 and aggregator_timeout_seconds > 0"),
            (self.max_agent_share is None or 0 < self.max_agent_share <= 1, "max_agent_share must be in (0, 1]"),
            (self.max_unauthenticated_calls >= 1 and self.max_unauthenticated_per_peer >= 1,
             "max_unauthenticated_calls and max_unauthenticated_per_peer must be >= 1"),
            (self.dataplane_handshake_seconds > 0, "dataplane_handshake_seconds must be > 0"),
            (self.max_dataplane_handshakes >= 1 and self.max_dataplane_handshakes_per_peer >= 1,
             "max_dataplane_handshakes and max_dataplane_handshakes_per_peer must be >= 1"),
            (self.upload_header_seconds > 0 and self.upload_idle_seconds > 0,
             "upload_header_seconds and upload_idle_seconds must be > 0"),
            (self.upload_min_bytes_per_second >= 0, "upload_min_bytes_per_second must be >= 0"),
            (self.max_joins_per_second > 0, "max_joins_per_second must be > 0"),
            (self.max_queued_uploads >= self.max_concurrent_uploads,
             "max_queued_uploads must be >= max_concurrent_uploads"),
            (self.max_concurrent_downloads >= 1, "max_concurrent_downloads must be >= 1"),
            (not self.virtual_clock or self.accept_populations,
             "the virtual clock needs accept_populations: only simulation hosts can report finish times"),
            (not self.virtual_clock or (self.aggregator_ranks == 1 and not self.secure_aggregation),
             "the virtual clock does not work with aggregator ranks or secure aggregation yet; drop one of them"),
            (self.round_wall_seconds > 0, "round_wall_seconds must be > 0"),
            (self.accept_populations or self.max_concurrent_rpcs >= 2 * self.min_available,
             "max_concurrent_rpcs must be at least twice min_available (every agent long-polls; a simulation's "
             "population members do not)"),
            (self.liveness_timeout_seconds > self.heartbeat_seconds,
             "liveness_timeout_seconds must exceed heartbeat_seconds"),
            (math.isfinite(self.secagg_clip) and self.secagg_clip > 0, "secagg_clip must be > 0"),
            (self.secagg_max_weight is None or self.secagg_max_weight >= 1, "secagg_max_weight must be >= 1"),
            (self.secagg_stage_seconds > 0, "secagg_stage_seconds must be > 0"),
            (self.data_plane in (None, True, False), "data_plane must be on, off or auto"),
            (0 <= self.data_port <= 65535, "data_port must be in 0..65535"),
            (self.data_plane_downloads >= 1, "data_plane_downloads must be >= 1"),
            (not self.secure_aggregation or (self.min_available >= 2 and (self.fraction is not None
                                                                       or self.clients_per_round >= 2)),
             "secure aggregation hides each update in a sum of several: it needs min_available >= 2 and "
             "clients_per_round >= 2"),
            (not (self.secure_aggregation and self.max_agent_share is not None),
             "secure aggregation hides each update's weight: bound it with --secagg-max-weight instead of "
             "--max-agent-share"),
            (not (self.secure_aggregation and self.upload_compression.method != "none"),
             "secure aggregation masks each update in a finite field, which cannot be compressed: use "
             "--compression none with --secure-aggregation"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.min_reports > self.clients_per_round and self.fraction is None:
            raise ValueError(f"min_reports ({self.min_reports}) cannot exceed clients_per_round "
                             f"({self.clients_per_round})")

    def wants_data_plane(self, model_bytes: int) -> bool:
        """Whether weights of ``model_bytes`` should move on the data plane."""
        return self.data_plane if self.data_plane is not None else model_bytes >= self.data_plane_min_bytes

    def target_reports(self, live: int) -> int:
        """K for a round with ``live`` agents available."""
        if self.fraction is not None:
            return max(self.min_reports, round(self.fraction * live))
        return self.clients_per_round

    def cohort_size(self, live: int) -> int:
        """M = ceil(K * overselect), capped at the number of live agents."""
        return min(live, math.ceil(self.target_reports(live) * self.overselect))
