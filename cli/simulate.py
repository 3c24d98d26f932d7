"""Run a federation on this machine: a real coordinator and N real agents talking gRPC on loopback.

Writes OUT/metrics.jsonl (one JSON object per round), OUT/summary.json and OUT/accuracy.png, and prints a
per-round table while it runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from fedpar.cli.argtypes import at_least_one, count, non_negative, non_negative_int, positive, probability
from fedpar.cli.compression_options import add_compression_arguments
from fedpar.cli.dp import DP_COLUMNS, add_dp_arguments, dp_strategy
from fedpar.cli.progress import CLOCK_COLUMNS, COLUMNS, JoiningBar, RoundTable
from fedpar.cli.observability import Observers, add_observability_arguments
from fedpar.cli.user_errors import check_output_folder, run_exit_code
from fedpar.server.aggregator_ranks import rank_columns
from fedpar.cli.strategy_options import add_strategy_option_argument, strategy_options_from_args
from fedpar.client.trainer import PRECISIONS
from fedpar.parallel.device import DEVICE_HELP
from fedpar.simulations.runner import SimulationConfig, run_simulation


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``fedpar simulate``."""
    d = SimulationConfig()
    p.add_argument("--clients", type=count, default=d.clients, help="number of simulated agents")
    p.add_argument("--rounds", type=count, default=d.rounds, help="federated rounds to run")
    p.add_argument("--dataset", default=d.dataset, help="digits (bundled with scikit-learn) or mnist")
    p.add_argument("--data-dir", default=d.data_dir, help="folder with MNIST train.npz/test.npz or the IDX files")
    p.add_argument("--partition", default=d.partition,
                   help="how data is split over clients: iid, dirichlet:ALPHA (label skew) or shards:N")
    p.add_argument("--model", default=d.model, help="mlp or cnn (the FedAvg paper's CNN)")
    p.add_argument("--strategy", default=d.strategy,
                   help="aggregation strategy, e.g. fedavg, fedavgm, fedadam, or flower:package.module:Class (a Flower "
                        "strategy, see fedpar serve --help)")
    add_strategy_option_argument(p, "simulate")
    p.add_argument("--clients-per-round", type=count, default=d.clients_per_round,
                   help="K, updates that close a round (default: all clients)")
    p.add_argument("--overselect", type=at_least_one, default=d.overselect,
                   help="sample ceil(K * overselect) clients per round; the first K updates count")
    p.add_argument("--min-reports", type=non_negative_int, default=d.min_reports,
                   help="a round with fewer accepted updates fails and keeps the old model")
    p.add_argument("--local-epochs", type=count, default=d.local_epochs, help="local epochs per round (E)")
    p.add_argument("--batch-size", type=count, default=d.batch_size, help="local batch size (B)")
    p.add_argument("--lr", dest="learning_rate", type=positive, default=d.learning_rate, help="local SGD learning rate")
    p.add_argument("--deadline", dest="deadline_seconds", type=positive, default=d.deadline_seconds,
                   help="straggler deadline per round, in seconds")
    p.add_argument("--val-fraction", type=probability, default=d.val_fraction,
                   help="share of each client's data kept for federated evaluation")
    p.add_argument("--slow-fraction", type=probability, default=d.slow_fraction, help="share of clients that are slow")
    p.add_argument("--slow-step-delay", type=non_negative, default=d.slow_step_delay,
                   help="extra seconds per local step on a slow client")
    p.add_argument("--drop-probability", type=probability, default=d.drop_probability,
                   help="chance per client per round of vanishing before it uploads")
    p.add_argument("--secure-aggregation", action="store_true",
                   help="SecAgg+ masking: the coordinator learns only the weighted mean of the updates")
    add_compression_arguments(p)
    p.add_argument("--workers", type=count, default=d.workers, help="agent processes (agents are threads in them)")
    p.add_argument("--examples-per-client", type=count, default=d.examples_per_client,
                   help="keep at most this many of each client's examples (populations of different sizes with "
                        "clients of the same size)")
    p.add_argument("--virtual-clients", action="store_true",
                   help="the worker processes host the population (a few bytes per client) and only the clients "
                        "sampled in a round get a model and their data, for that round: populations of 100,000")
    p.add_argument("--trace", default=d.trace,
                   help="with --virtual-clients: system traces, 'fedscale' (generated: long-tailed speeds, diurnal "
                        "availability) or a CSV/JSON file (columns in simulations/traces.py); a client's speed "
                        "slows its steps and its availability decides when it can be sampled")
    p.add_argument("--trace-day-seconds", type=positive, default=d.trace_day_seconds,
                   help="real seconds one day of the trace lasts (e.g. 60: availability cycles every minute)")
    p.add_argument("--clock", choices=("real", "virtual"), default=d.clock,
                   help="with --virtual-clients: 'virtual' runs the deadline and first-K on simulated time (each "
                        "client's finish time from its trace and its work); only the first K in time train, so "
                        "rounds run as fast as the machine allows and the table shows simulated seconds")
    p.add_argument("--target-accuracy", type=probability, default=d.target_accuracy,
                   help="summary.json reports the rounds, wall and simulated seconds to reach this test accuracy")
    p.add_argument("--seats", type=count, default=d.seats,
                   help="with --virtual-clients: sampled clients training at once in one worker process")
    p.add_argument("--device", default=d.device,
                   help=f"where agents train and the coordinator evaluates: {DEVICE_HELP}; with several GPUs the "
                        "worker processes are dealt over them")
    p.add_argument("--precision", default=d.precision, choices=PRECISIONS,
                   help="bf16: agents run forward passes under bf16 autocast (weights and uploads stay fp32)")
    p.add_argument("--client-batching", action="store_true",
                   help="the agents of one worker process that train in the same round train together as one "
                        "batched model (torch.func), each with its own data, batches, steps and deadline; slow "
                        "devices (--slow-fraction) and FedProx keep their meaning, and SecAgg, compression and "
                        "DP still apply to each agent's update. Models with dropout or batch norm are refused")
    p.add_argument("--aggregator-ranks", type=count, default=d.aggregator_ranks,
                   help="coordinator processes sharing each round's downloads, uploads and fold (as serve's "
                        "--aggregator-ranks); the table shows each rank's uploads and fold seconds")
    p.add_argument("--seed", type=int, default=d.seed, help="seed for data split, sampling and initial weights")
    p.add_argument("--tls", action="store_true",
                   help="run every agent over mutual TLS with throw-away certificates (default: plaintext on "
                        "loopback, which never leaves this machine)")
    p.add_argument("--out", default="runs/simulation", help="output folder")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    add_dp_arguments(p, population_flag=False)
    add_observability_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Run the simulation and print the summary."""
    check_output_folder(args.out)
    fields = set(SimulationConfig.__dataclass_fields__)
    cfg = SimulationConfig(**{k: v for k, v in vars(args).items() if k in fields})
    columns = COLUMNS + (DP_COLUMNS if args.dp != "off" else []) + \
        (rank_columns(cfg.aggregator_ranks) if cfg.aggregator_ranks > 1 else []) + \
        (CLOCK_COLUMNS if cfg.clock == "virtual" else [])
    table = RoundTable(total=cfg.rounds, stream=sys.stdout, quiet=args.quiet, columns=columns)
    observers = Observers(args)
    joining = JoiningBar(quiet=args.quiet)
    try:
        cfg.strategy_options = strategy_options_from_args(args)
        cfg.strategy, options = dp_strategy(args, cfg.strategy, cfg.clients_per_round or cfg.clients,
                                            cfg.overselect, cfg.clients)
        cfg.strategy_options.update(options)
        callbacks = [lambda _: joining.close(), table.row, *observers.round_callbacks()]
        summary = run_simulation(cfg, on_round=lambda row: [f(row) for f in callbacks], on_server=observers.attach,
                                 on_joining=joining.update)
    except ValueError as exc:
        print(f"fedpar simulate: {exc}", file=sys.stderr)
        return 2
    finally:
        joining.close()
        observers.close()
    summary.pop("config", None)
    print(json.dumps(summary, indent=2))
    print(f"wrote {cfg.out}/metrics.jsonl, metrics.csv, summary.json, accuracy.png and labels.png")
    return run_exit_code("fedpar simulate", summary)

