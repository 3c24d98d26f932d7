"""One simulated federation's settings, declared once: `fedpar simulate`'s options are generated from them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from fedpar.datasets.registry import full_dataset_name
from fedpar.datasets.settings import DataFiles, DataSource, Partitioning
from fedpar.parallel.config import Device, Precision
from fedpar.protocol.compressed_wire import CompressionConfig
from fedpar.protocol.task_settings import LocalTraining
from fedpar.sections import Output, Plots, Seeded
from fedpar.server.config import (AccuracyTarget, AggregatorRanks, CoordinatorConfig, RoundClock, RoundSampling,
                                  SecureAggregation, StrategyChoice)
from fedpar.settings import DEFINES, NOTED, RESUME, UNRECORDED, as_given, flag_of, redefault, setting
from fedpar.simulations.traces import check_day_seconds
from fedpar.task import FlowerAppReference, TaskReference


# Clients a round samples when --clients-per-round is not given and there are more: a population of 10^5 would
# otherwise train every client each round (6.3 GiB at 10^5); the population runs sample 100.
DEFAULT_COHORT = 100
WAITING_SEATS = 4  # a worker's seats where members wait (measured best of 2/4/8 here); none waits: 1


@dataclass
class Population:
    """A simulated population: its size, and how heterogeneous its clients are (`simulate`, `simulate-workers`)."""

    clients: int = setting(10, check="count", group="simulation",
                           help="clients in the simulated population (simulate: 10, or a --flower-app's "
                                "options.num-supernodes; simulate-workers: the whole population over every process, "
                                "as the coordinator's --min-available; it must be given there)", resume=DEFINES)
    examples_per_client: int | None = setting(
        None, check="count", group="simulation",
        help="keep at most this many of each client's examples (populations of different sizes with clients of the "
             "same size)", resume=DEFINES)
    slow_fraction: float = setting(0.0, check="probability", group="simulation",
                                   help="share of clients that are slow devices", resume=NOTED)
    slow_step_delay: float = setting(0.05, check="step_delay", group="simulation",
                                     help="extra seconds per local step on a slow client", resume=NOTED)
    drop_probability: float = setting(0.0, check="probability", group="simulation",
                                      help="chance per client per round of vanishing before it uploads", resume=NOTED)
    trace: str | None = setting(
        None, group="simulation",
        help="system traces, 'fedscale' (generated from --seed: long-tailed speeds, diurnal availability) or a "
             "CSV/JSON file (columns in simulations/traces.py); a client's speed slows its steps and its availability "
             "decides when it can be sampled", resume=NOTED)
    trace_day_seconds: float = setting(86_400.0, check="seconds", group="simulation",
                                       help="real seconds one day of the trace lasts (e.g. 60: availability cycles "
                                            "every minute; at least 2, as often as the hosts read it)", resume=NOTED)
    seats: int | None = setting(
        None, check="count", group="simulation",
        help="sampled clients training at once in one worker process; when not given, 1 where no seat would wait "
             "(the built-in data, each member's update small and sent in the background, no slow device sleeping on "
             f"the real clock), else {WAITING_SEATS}, so that a member's upload, its top-k verdict, a secure round's "
             "masked upload, a --task's data loading or a slow device's sleep overlaps the next member's training "
             f"(simulate-workers, which learns a round's settings only from its tasks: {WAITING_SEATS})",
                                resume=UNRECORDED)

    def __post_init__(self) -> None:
        check_day_seconds(self.trace_day_seconds)  # from the command line, a TOML file or Python alike


# Sections are listed last first: a dataclass takes its bases' fields from the last base on.
@dataclass
class SimulationConfig(Output, Plots, AccuracyTarget, Precision, Device, Population, RoundClock, SecureAggregation,
                       AggregatorRanks, StrategyChoice, FlowerAppReference, TaskReference, Seeded, Partitioning,
                       DataFiles, DataSource,
                       LocalTraining, RoundSampling):
    """One simulated federation: data, model, rounds, and how heterogeneous the clients are."""

    clients_per_round: int | None = redefault(RoundSampling, "clients_per_round", None)  # None: all, to DEFAULT_COHORT
    checkpoint_dir: Path | None = redefault(CoordinatorConfig, "checkpoint_dir", None)
    overselect: float = redefault(RoundSampling, "overselect", 1.0)  # K is all the clients by default
    workers: int = setting(2, check="local_processes", group="simulation",
                           help="worker processes hosting the population (a few bytes per client; only the clients "
                                "sampled in a round get a model and their data)", resume=UNRECORDED)
    tls: bool = setting(False, group="simulation",
                        help="run every worker process's connection over mutual TLS with throw-away certificates "
                             "(a worker's certificate speaks for the clients it hosts; default: plaintext on "
                             "loopback, which never leaves this machine)", resume=UNRECORDED)
    client_batching: bool | None = setting(
        None, choices={"auto": None, "on": True, "off": False}, group="simulation", metavar="auto|on|off",
        help="the clients one worker process trains in a round (a seat each) run the local loop together as one "
             "stacked model (torch.func), each with its own data, batches, steps and deadline; slow devices "
             "(--slow-fraction) and FedProx keep their meaning, and SecAgg, compression and DP still apply to each "
             "client's update. auto (the default): batch where the model allows it, on a GPU when each worker "
             "holds at least 2 clients of a round, on the CPU for a model without convolutions when each worker "
             "trains at least 5 clients of a round and every client is sampled (where it was measured faster), "
             "else one by one; on (a bare --client-batching): always, refusing in one line what cannot batch (dropout, "
             "batch norm, --precision bf16, a task's own train hook or loader, a non-elementwise optimizer); off: "
             "one by one", resume=UNRECORDED)
    # how agents compress uploads; a resume notes its flags' values (resume_record)
    upload_compression: CompressionConfig = field(default_factory=CompressionConfig, metadata={RESUME: NOTED})

    def settled(self) -> tuple[SimulationConfig, list[str]]:
        """A copy with the settings that ask for more clients than there are brought down to ``clients``, and one
        line for each (what was asked, what is used), so that nothing is changed in silence. Settled settings
        settle to themselves, with no lines."""
        clients = f"{flag_of(SimulationConfig, 'clients')} {self.clients}"
        notes, changes = [], {}
        if self.clients_per_round is None and self.clients > DEFAULT_COHORT and not self.flower_app:
            notes.append(f"sampling {DEFAULT_COHORT} of the {self.clients} clients each round (all of them, up to "
                         f"{DEFAULT_COHORT}, unless {flag_of(SimulationConfig, 'clients_per_round')} says how many)")
            changes["clients_per_round"] = DEFAULT_COHORT
        if self.clients_per_round is not None and self.clients_per_round > self.clients:
            notes.append(f"{flag_of(SimulationConfig, 'clients_per_round')} {self.clients_per_round} is above "
                         f"{clients}; using {self.clients}")
            changes["clients_per_round"] = self.clients
        if self.seats is not None and self.seats > self.clients:  # a seat trains one client at a time
            notes.append(f"{flag_of(SimulationConfig, 'seats')} {self.seats} is above {clients}; using {self.clients} "
                         "(a seat trains one sampled client at a time)")
            changes["seats"] = self.clients
        if self.workers > self.clients:
            if self.workers != SimulationConfig.workers:  # the default is lowered unsaid: nobody asked for it
                notes.append(f"{flag_of(SimulationConfig, 'workers')} {self.workers} is above {clients}; using "
                             f"{self.clients} (a worker process hosts at least one client)")
            changes["workers"] = self.clients
        k = changes.get("clients_per_round", self.clients_per_round) or self.clients
        if math.ceil(k * self.overselect) > self.clients:
            overselect = self.clients / k  # samples them all
            while math.ceil(k * overselect) > self.clients:  # 10 / 3 * 3 may come to a hair above 10
                overselect = math.nextafter(overselect, 0.0)
            notes.append(f"{flag_of(SimulationConfig, 'overselect')} {self.overselect:g} would sample "
                         f"{math.ceil(k * self.overselect)} clients per round, more than {clients}; sampling all "
                         f"{self.clients} (--overselect {overselect:.4g})")
            changes["overselect"] = overselect
        return replace(self, **changes), notes

    def resume_record(self) -> tuple[dict, dict]:
        """What a ``--checkpoint-dir`` keeps of these settings, by flag: (defining, noted), as each setting declares
        (``setting(resume=...)``: :data:`~fedpar.settings.DEFINES`, :data:`~fedpar.settings.NOTED`,
        :data:`~fedpar.settings.UNRECORDED`). A resume that differs in a defining one is refused: they say which
        federation is simulated (its clients, the data each holds, the model, the task), so rounds before and after
        the checkpoint would belong to two federations in one metrics.jsonl; and the clock (simulated time counts only
        on the virtual one, so rounds on two clocks give no run's sim_seconds). A noted one only changes how the
        remaining rounds train (sampling, local training, the devices' behaviour, the strategy's options,
        compression); changing them between rounds is a schedule a user may mean, as lowering --lr late, so it is
        said in one line and resumed. Kept by neither: how the run is hosted here (workers, seats, device, ranks,
        TLS, folders); --rounds (a resume may run more); the strategy (the checkpoint itself refuses another:
        server/coordinator.py); the time limits of a round and a secure stage (guards, not training); the target
        accuracy (the summary counts its time to target again from the rows when it changed)."""
        roles = {f.name: f.metadata.get(RESUME) for f in fields(self)}
        defining = {name: getattr(self, name) for name, role in roles.items() if role == DEFINES}
        defining["dataset"] = full_dataset_name(self.dataset, self.clients)  # as every process builds it
        noted = {name: getattr(self, name) for name, role in roles.items()
                 if role == NOTED and name != "upload_compression"}  # kept by its own flags, below
        noted["clients_per_round"] = self.clients_per_round or self.clients  # None: all of them
        privacy = {}
        if self.strategy.startswith("dp-"):  # --privacy's options joined --strategy-option's: said by their flags
            from fedpar.cli.privacy import split_privacy_options
            noted["strategy_options"], privacy = split_privacy_options(self.strategy_options)
        # by the flags that set them, as given, so that a resume's line names what the user typed
        compression = {flag_of(CompressionConfig, k): getattr(self.upload_compression, k)
                       for k in ("method", "topk_ratio", "int8_block")}
        return ({flag_of(SimulationConfig, k): as_given(SimulationConfig, k, v) for k, v in defining.items()},
                {**{flag_of(SimulationConfig, k): as_given(SimulationConfig, k, v) for k, v in noted.items()},
                 **compression, **privacy})
