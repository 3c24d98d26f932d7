"""One simulated federation's settings, declared once: `fedpar simulate`'s options are generated from them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from fedpar.parallel.config import DEVICE_HELP, PRECISIONS
from fedpar.protocol.local_training import LocalTraining
from fedpar.settings import flag_of, setting
from fedpar.task import TaskReference


@dataclass
class SimulationConfig(TaskReference, LocalTraining):
    """One simulated federation: data, model, rounds, and how heterogeneous the clients are."""

    clients: int = setting(10, check="count", group="rounds", help="number of simulated agents")
    rounds: int = setting(10, check="count", group="rounds", help="federated rounds to run")
    dataset: str = setting("digits", group="data", help="digits (bundled with scikit-learn) or mnist")
    data_dir: str | None = setting(None, group="data", help="folder with MNIST train.npz/test.npz or the IDX files")
    partition: str = setting("iid", group="data",
                             help="how data is split over clients: iid, dirichlet:ALPHA (label skew) or shards:N")
    model: str = setting("mlp", group="data", help="mlp or cnn (the FedAvg paper's CNN)")
    strategy: str = "fedavg"
    clients_per_round: int | None = setting(None, check="count", group="rounds",
                                            help="K, updates that close a round (default: all clients)")
    overselect: float = setting(1.0, check="at_least_one", group="rounds",
                                help="sample ceil(K * overselect) clients per round; the first K updates count")
    min_reports: int = setting(1, check="non_negative_int", group="rounds",
                               help="a round with fewer accepted updates fails and keeps the old model")
    deadline_seconds: float = setting(60.0, check="positive", flag="deadline", group="rounds",
                                      help="straggler deadline per round, in seconds")
    val_fraction: float = setting(0.1, check="probability", group="data",
                                  help="share of each client's data kept for federated evaluation")
    slow_fraction: float = setting(0.0, check="probability", group="simulation",
                                   help="share of clients that are slow devices")
    slow_step_delay: float = setting(0.05, check="non_negative", group="simulation",
                                     help="extra seconds per local step on a slow client")
    drop_probability: float = setting(0.0, check="probability", group="simulation",
                                      help="chance per client per round of vanishing before it uploads")
    compression: str = "none"  # how agents compress their uploads: none, fp16, bf16, int8, topk (CompressionConfig)
    topk_ratio: float = 0.01
    int8_block: int = 256
    workers: int = setting(2, check="count", group="simulation", help="agent processes (agents are threads in them)")
    device: str = setting("auto", group="simulation",
                          help=f"where agents train and the coordinator evaluates: {DEVICE_HELP}; with several GPUs "
                               "the worker processes are dealt over them")
    precision: str = setting("fp32", choices=PRECISIONS, group="training",
                             help="bf16: agents run forward passes under bf16 autocast (weights and uploads stay fp32)")
    secure_aggregation: bool = setting(False, group="secagg",
                                       help="SecAgg+ masking: the coordinator learns only the weighted mean of the "
                                            "updates")
    seed: int = setting(0, group="rounds", help="seed for data split, sampling and initial weights")
    out: str | None = None
    tls: bool = setting(False, group="simulation",
                        help="run every agent over mutual TLS with throw-away certificates (default: plaintext on "
                             "loopback, which never leaves this machine)")
    client_batching: bool = setting(
        False, group="simulation",
        help="the agents of one worker process that train in the same round train together as one batched model "
             "(torch.func), each with its own data, batches, steps and deadline; slow devices (--slow-fraction) and "
             "FedProx keep their meaning, and SecAgg, compression and DP still apply to each agent's update. Models "
             "with dropout or batch norm are refused")
    aggregator_ranks: int = setting(1, check="count", group="simulation",
                                    help="coordinator processes sharing each round's downloads, uploads and fold (as "
                                         "serve's --aggregator-ranks); the table shows each rank's uploads and fold "
                                         "seconds")
    examples_per_client: int | None = setting(
        None, check="count", group="data",
        help="keep at most this many of each client's examples (populations of different sizes with clients of the "
             "same size)")
    virtual_clients: bool = setting(
        False, group="simulation",
        help="the worker processes host the population (a few bytes per client) and only the clients sampled in a "
             "round get a model and their data, for that round: populations of 100,000")
    trace: str | None = setting(
        None, group="simulation",
        help="with --virtual-clients: system traces, 'fedscale' (generated: long-tailed speeds, diurnal "
             "availability) or a CSV/JSON file (columns in simulations/traces.py); a client's speed slows its steps "
             "and its availability decides when it can be sampled")
    trace_day_seconds: float = setting(86_400.0, check="positive", group="simulation",
                                       help="real seconds one day of the trace lasts (e.g. 60: availability cycles "
                                            "every minute)")
    seats: int = setting(4, check="count", group="simulation",  # measured best of 2/4/8 here
                         help="with --virtual-clients: sampled clients training at once in one worker process")
    clock: str = setting(
        "real", group="simulation", choices=("real", "virtual"),
        help="with --virtual-clients: 'virtual' runs the deadline and first-K on simulated time (each client's finish "
             "time from its trace and its work); only the first K in time train, so rounds run as fast as the machine "
             "allows and the table shows simulated seconds")
    target_accuracy: float | None = setting(
        None, check="probability", group="simulation",
        help="summary.json reports the rounds, wall and simulated seconds to reach this test accuracy")
    strategy_options: dict = field(default_factory=dict)

    def settled(self) -> tuple[SimulationConfig, list[str]]:
        """A copy with the settings that ask for more clients than there are brought down to ``clients``, and one
        line for each (what was asked, what is used), so that nothing is changed in silence. Settled settings
        settle to themselves, with no lines."""
        clients = f"{flag_of(SimulationConfig, 'clients')} {self.clients}"
        notes, changes = [], {}
        if self.clients_per_round is not None and self.clients_per_round > self.clients:
            notes.append(f"{flag_of(SimulationConfig, 'clients_per_round')} {self.clients_per_round} is above "
                         f"{clients}; using {self.clients}")
            changes["clients_per_round"] = self.clients
        if self.workers > self.clients:
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
