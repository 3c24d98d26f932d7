"""Coordinator settings, as one dataclass."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from fedpar.protocol.compressed_wire import CompressionConfig
from fedpar.protocol.codec import DEFAULT_CHUNK_BYTES, MAX_POPULATION_JOIN
from fedpar.protocol.task_settings import LocalTraining
from fedpar.secagg.field import MAX_CLIP
from fedpar.sections import Seeded
from fedpar.settings import DEFINES, NOTED, UNRECORDED, check_declared, redefault, setting


DATA_PLANE_MIN_BYTES = 8 << 20
# serve's --data-plane (auto|on|off: whether the coordinator offers it) and client's (whether an agent takes it): two
# settings under one flag, which --help describes alike
DATA_PLANE_HELP = ("move weights over the data plane, a bulk socket beside gRPC (TLS with the same certificates when "
                   f"gRPC uses TLS): the coordinator offers it (auto = for models of at least "
                   f"{DATA_PLANE_MIN_BYTES >> 20} MiB) and agents take it (client --no-data-plane: it keeps to the "
                   "gRPC streams, as agents that do not support it do)")


@dataclass
class RoundSampling:
    """How many rounds run, how many updates close one, how many agents it samples, and its deadline."""

    rounds: int = setting(10, check="count", group="rounds", help="rounds to run", resume=UNRECORDED)
    clients_per_round: int | None = setting(
        10, check="count", group="rounds",
        help="K: the accepted updates that close a round, early, before its deadline (simulate: all its clients, up "
             "to 100, by default)", resume=NOTED)
    min_reports: int = setting(1, check="count", group="rounds",
                               help="a round with fewer accepted updates than this fails; the model stays as it was",
                               resume=NOTED)
    overselect: float = setting(1.3, check="at_least_one", group="rounds",  # FedScale's over-commitment
                                help="sample ceil(K x overselect) agents so that stragglers do not hold a round up; "
                                     "the first K updates count (simulate: 1 by default, as its K is all its "
                                     "clients)", resume=NOTED)
    deadline_seconds: float = setting(60.0, check="seconds", flag="deadline", group="rounds",
                                      help="straggler deadline in seconds, from task dispatch; later updates are "
                                           "refused", resume=NOTED)


@dataclass
class StrategyChoice:
    """Which aggregation strategy folds the updates, and its options (aggregation/registry.py checks them)."""

    strategy: str = setting("fedavg", group="strategy", help="aggregation strategy", resume=UNRECORDED)
    strategy_options: dict = setting(default_factory=dict, flag="strategy-option", metavar="KEY=VALUE",
                                     group="strategy", help="set an option of --strategy (repeatable)", resume=NOTED)


@dataclass
class AggregatorRanks:
    """Coordinator processes that split each round's ingest and fold (server/aggregator_ranks.py)."""

    aggregator_ranks: int = setting(
        1, check="local_processes", group="coordinator",
        help="coordinator processes that share each round's downloads, uploads and fold, joined by an all-reduce; "
             "agents are told which rank to use and the round table shows each rank's uploads and fold seconds "
             "(serve: rank r listens on --port + r, or a free port with --port 0; under torchrun every launched "
             "process is one rank and this is ignored)", resume=UNRECORDED)
    aggregator_timeout_seconds: float = setting(
        120.0, check="seconds", flag="aggregator-timeout", group="coordinator",
        help="with --aggregator-ranks above 1 (or under torchrun): longest wait for another aggregator rank in a "
             "collective; a rank that misses it (or dies) is dropped "
             "and the coordinator goes on with the others, which lose only its share of the open round",
                                                resume=UNRECORDED)


@dataclass
class SecureAggregation:
    """SecAgg+ masking of the updates (secagg/)."""

    secure_aggregation: bool = setting(False, group="secagg",
                                       help="SecAgg+ masking: the coordinator learns only the weighted mean of the "
                                            "agents' updates (needs a linear strategy, one that uses only their "
                                            "weighted mean, such as fedavg: a refusal lists them)", resume=NOTED)
    secagg_clip: float = setting(1.0, check="secagg_clip", group="secagg",
                                 help="with --secure-aggregation: clip each coordinate of an update (local - global) "
                                      "to +-this", resume=NOTED)
    secagg_max_weight: int | None = setting(
        None, check="secagg_weight", group="secagg",
        help="with --secure-aggregation: cap on an agent's weight (default: largest registered examples x local "
             "epochs in the cohort)", resume=NOTED)
    secagg_stage_seconds: float = setting(30.0, check="seconds", group="secagg",
                                          help="with --secure-aggregation: longest wait for each key-exchange stage "
                                               "(at most a third of --deadline) and for unmasking",
                                          resume=UNRECORDED)


@dataclass
class RoundClock:
    """Whether rounds run on real or simulated time (server/virtual_clock.py)."""

    virtual_clock: bool = setting(
        False, group="coordinator", flag="clock", key="clock", choices={"real": False, "virtual": True},
        help="'virtual' runs the deadline and first-K on simulated time: each member's finish time comes from its "
             "trace and its work and only the first K in time train, so rounds run as fast as the machine allows "
             "and the table shows simulated seconds (needs simulation hosts: serve --accept-populations; every "
             "simulate has them)",
        # a resume may not change it: simulated seconds are counted only on the virtual clock, so a run on two clocks
        # would carry a sim_seconds that is neither clock's
        resume=DEFINES)
    round_wall_seconds: float = setting(600.0, check="seconds", flag="round-wall-timeout", group="coordinator",
                                        help="with --clock virtual: the longest real time a round may take",
                                        resume=UNRECORDED)


@dataclass
class AccuracyTarget:
    """A test accuracy the run's summary times (protocol/run_logs.py)."""

    target_accuracy: float | None = setting(
        None, check="probability", group="outputs",
        help="summary.json reports the rounds, wall and simulated seconds to reach this central test accuracy",
                                            resume=UNRECORDED)


# Sections are listed last first: a dataclass takes its bases' fields from the last base on.
@dataclass
class CoordinatorConfig(AccuracyTarget, RoundClock, SecureAggregation, AggregatorRanks, LocalTraining, Seeded,
                        RoundSampling):
    """Everything that shapes the coordinator's rounds and its limits (and the local training its tasks ask for)."""

    clients_per_round: int = redefault(RoundSampling, "clients_per_round", 10)
    # if set, K = max(min_reports, round(fraction * live agents))
    fraction: float | None = setting(None, check="fraction", group="rounds",
                                     help="alternative to --clients-per-round: K = fraction x live agents")
    min_available: int = setting(2, check="count", group="rounds", help="live agents needed before a round starts")
    heartbeat_seconds: float = setting(5.0, check="seconds", flag="heartbeat", group="coordinator",
                                       help="seconds between agent heartbeats")
    liveness_timeout_seconds: float = setting(20.0, check="seconds", flag="liveness-timeout", group="coordinator",
                                              help="an agent silent this long is not sampled")
    max_chunk_bytes: int = setting(DEFAULT_CHUNK_BYTES, check="count", group="transfer",
                                   help="largest tensor chunk accepted")
    # Models up to this size (and one chunk) travel inside each task: one call less per agent and round; 0: never.
    # Every task reply of a round then carries a copy, so keep it small next to the number of agents.
    inline_weights_max_bytes: int = setting(
        64 << 10, check="non_negative_int", flag="inline-weights-bytes", group="transfer",
        help="models up to this size (and one chunk) travel inside each task instead of a separate download call; "
             "every task reply of a round carries a copy; 0 = always download")
    max_model_bytes: int = setting(8 << 30, check="count", group="limits",
                                   help="largest model (sum of tensor bytes) an upload header may describe")
    max_concurrent_uploads: int = setting(4, check="count", group="limits",
                                          help="uploads staged at once (each holds one model copy)")
    max_upload_chunks: int = setting(100_000, check="count", group="limits",  # tiny chunks cost CPU per message
                                     help="most data chunks in one upload (the chunk size itself is --max-chunk-bytes)")
    max_calls_per_agent: int = setting(8, check="count", group="limits",
                                       help="calls/streams one agent may have in flight at once (long-poll, "
                                            "heartbeat, download, upload)")
    max_upload_attempts_per_round: int = setting(4, check="count", flag="max-upload-attempts", group="limits",
                                                 help="uploads one agent may start per round (retries after a "
                                                      "broken-off upload)")
    max_upload_bytes_per_second: float | None = setting(
        None, check="positive", group="limits",
        help="per-agent upload rate in bytes/s after a burst of two models; unset: unlimited")
    max_agents: int = setting(100_000, check="count", group="limits",
                              help="registered agents; a Join from a new agent beyond this is refused")
    upload_header_seconds: float = setting(2.0, check="seconds", group="limits",
                                           help="a call must send its request (an upload stream: its header) within "
                                                "this time; nothing is authenticated before")
    upload_idle_seconds: float = setting(10.0, check="seconds", group="limits",
                                         help="a staged upload silent this long loses its staging slot (the agent "
                                              "may send it again); a data-plane download whose reader is "
                                              "silent this long is dropped")
    upload_min_bytes_per_second: float = setting(
        32 << 10, check="non_negative", group="limits",
        help="a staged upload slower than this on average (from 2 s after it got its staging slot, or "
             "--upload-idle-seconds if shorter) loses its slot; while others wait for a slot, at once; a "
             "data-plane download read slower than this is dropped")
    max_unauthenticated_calls: int = setting(
        1024, check="count", group="limits",
        help="calls still waiting for their request or upload header (not yet authenticated), in total; they never "
             "count against --max-concurrent-rpcs, and beyond this the oldest is let go")
    max_unauthenticated_per_peer: int = setting(128, check="count", group="limits",
                                                help="the same, from one peer (its certificate's name, else its "
                                                     "address)")
    max_examples_per_agent: int = setting(
        10_000_000, check="count", group="limits",
        help="largest example count an agent may declare at Join; FedAvg weighs its updates by at most that times "
             "the local epochs (the count is fixed by its first Join)")
    max_agent_share: float | None = setting(
        None, check="fraction", group="limits",
        help="cap on one update's share of a round's total weight, e.g. 0.5 (unset: no cap); heavier updates are "
             "weighted down to it when the round closes (streaming strategies)")
    max_joins_per_second: float = setting(500.0, check="positive", group="limits",
                                          help="server-wide Join rate, with a burst of five seconds' worth")
    max_concurrent_rpcs: int = setting(20_000, check="count", group="limits",
                                       help="server-wide calls in flight (every agent holds a long-poll, so keep it "
                                            "> 2 x agents)")
    max_queued_uploads: int = setting(64, check="count", group="limits",
                                      help="uploads staged or waiting for a staging slot; beyond this agents are "
                                           "told to retry")
    max_concurrent_downloads: int = setting(64, check="count", group="limits",
                                            help="weight downloads streamed at once; further downloads wait their "
                                                 "turn")
    wait_for_agents_seconds: float | None = None  # None: wait forever for min_available agents
    checkpoint_dir: Path | None = setting(None, group="coordinator",
                                          help="checkpoint every round here, and resume from it after a restart "
                                               "(same model and strategy)", resume=UNRECORDED)
    metrics_path: Path | None = None
    flower_run_config: dict | None = None  # a Flower App run's run config, sent in every task (TaskSettings.run_config)
    # bulk socket transfers beside gRPC; None: on for models >= data_plane_min_bytes
    data_plane: bool | None = setting(
        None, choices={"auto": None, "on": True, "off": False}, group="transfer",
        help=DATA_PLANE_HELP)
    data_plane_min_bytes: int = DATA_PLANE_MIN_BYTES
    data_port: int = setting(0, check="port", group="transfer",
                             help="port of the data plane on --host (0 picks a free one; agents learn it with each "
                                  "task)")
    data_plane_downloads: int = 8  # data-plane downloads served at once (uploads: max_concurrent_uploads)
    dataplane_handshake_seconds: float = setting(
        2.0, check="seconds", group="limits",
        help="a data-plane connection must finish its TLS handshake and send its ticket (and upload header) within "
             "this time; until then it holds no transfer thread")
    max_dataplane_handshakes: int = setting(256, check="count", group="limits",
                                            help="data-plane connections not yet authenticated, in total; beyond "
                                                 "this the oldest is closed")
    max_dataplane_handshakes_per_peer: int = setting(64, check="count", group="limits",
                                                     help="the same, from one address")
    upload_compression: CompressionConfig = field(default_factory=CompressionConfig)  # agents compress their deltas
    fold_dtype: str = setting(
        "float32", group="strategy", choices=("float32", "float64"),
        help="what the running weighted sums accumulate in: float64 costs twice the memory and traffic, and makes one "
             "rank's and several ranks' models agree to float64 rounding (bit for bit when every coordinate's "
             "weighted values span less than 2^19: then the float64 sums are exact)")
    accept_populations: bool = setting(False, group="coordinator",
                                       help="let simulation hosts (`fedpar simulate-workers`) register virtual "
                                            "populations: members without certificates of their own, live while "
                                            "their host calls")
    max_population_join: int = MAX_POPULATION_JOIN  # members in one JoinPopulation call (lower in tests)
    # simulate on the real clock with availability traces: min_available counts the members that joined, those
    # offline by their trace too, once one is live (a round samples the live ones); elsewhere it counts live ones
    joined_count_as_available: bool = False

    def __post_init__(self) -> None:
        check_declared(self)  # a config built in Python: the types and ranges its flags are refused outside of

    def _secagg_sum_fits(self) -> tuple[bool, str]:
        """Whether the sum of the sampled agents' weights (at most secagg_max_weight each) fits secure aggregation's
        31-bit field (secagg/field.py): every round failed on it, said only in metrics.jsonl."""
        if not self.secure_aggregation or self.secagg_max_weight is None or self.fraction is not None:
            return True, ""
        sampled = max(2, math.ceil(self.clients_per_round * self.overselect))
        fits = (1 << 31) - 1
        return (sampled * self.secagg_max_weight <= fits,
                f"secagg_max_weight ({self.secagg_max_weight}) x the {sampled} agents sampled per round must fit "
                f"secure aggregation's 31-bit sum: give secagg_max_weight {fits // sampled} or less")

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
            (self.round_wall_seconds > 0, "round_wall_seconds must be > 0"),
            (self.accept_populations or self.max_concurrent_rpcs >= 2 * self.min_available,
             "max_concurrent_rpcs must be at least twice min_available (every agent long-polls; a simulation's "
             "population members do not)"),
            (self.liveness_timeout_seconds > self.heartbeat_seconds,
             "liveness_timeout_seconds must exceed heartbeat_seconds"),
            (0 < self.secagg_clip <= MAX_CLIP, f"secagg_clip must be in (0, {MAX_CLIP:g}]"),
            (self.secagg_max_weight is None or self.secagg_max_weight >= 1, "secagg_max_weight must be >= 1"),
            self._secagg_sum_fits(),
            (self.secagg_stage_seconds > 0, "secagg_stage_seconds must be > 0"),
            (self.data_plane in (None, True, False), "data_plane must be on, off or auto"),
            (0 <= self.data_port <= 65535, "data_port must be in 0..65535"),
            (self.data_plane_downloads >= 1, "data_plane_downloads must be >= 1"),
            (not self.secure_aggregation or (self.min_available >= 2 and (self.fraction is not None
                                                                       or self.clients_per_round >= 2)),
             "secure aggregation hides each update in a sum of several: it needs min_available >= 2 (simulate: "
             "--clients) and clients_per_round >= 2"),
        ]
        # imported here: building the CLI's parsers reads this module and must not import torch (aggregation does)
        from fedpar.aggregation.compatibility import composition_features, refusal

        clash = refusal(composition_features("", self.secure_aggregation, self.upload_compression.method,
                                             self.max_agent_share))
        checks.append((clash is None, clash))
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.min_reports > self.clients_per_round and self.fraction is None:
            raise ValueError(f"min_reports ({self.min_reports}) cannot exceed clients_per_round "
                             f"({self.clients_per_round})")

    def wants_data_plane(self, model_bytes: int) -> bool:
        """Whether weights of ``model_bytes`` should move on the data plane."""
        return self.data_plane if self.data_plane is not None else model_bytes >= self.data_plane_min_bytes
