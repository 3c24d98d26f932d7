"""Host a slice of a virtual population against a running coordinator (`fedpar serve --accept-populations`),
one slice per process of a torchrun (or srun) launch, on one machine or many:

    torchrun --nnodes M --nproc-per-node P -m fedpar simulate-workers --server HOST:PORT --clients N ...

Every process joins torch.distributed's group (rendezvous and rank numbering are torchrun's), builds the same
data and partition from the seed, and hosts clients rank, rank + world, ... (simulations/population.py). The
coordinator samples, times and folds; it must be started with --min-available N to wait for the whole population.
"""

from __future__ import annotations

import argparse
import sys

from fedpar.cli.agent_setup import add_reconnect_arguments
from fedpar.cli.argtypes import count, non_negative, probability
from fedpar.cli.declared import section
from fedpar.cli.log_level import setup_logging
from fedpar.parallel.config import DEVICE_HELP

LOG_LEVEL = "warning"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``fedpar simulate-workers``."""
    g = section(p, "connection")
    g.add_argument("--server", required=True, help="the coordinator, HOST:PORT (plaintext: loopback or a private "
                                                   "network; members have no certificates of their own)")
    add_reconnect_arguments(g)
    g = section(p, "data")
    g.add_argument("--clients", type=count, required=True, help="the whole population, over every process")
    g.add_argument("--dataset", default="digits", help="digits, mnist, synthetic:ALPHA:BETA, npz:PATH or csv:PATH")
    g.add_argument("--data-dir", help="folder with the MNIST files (for --dataset mnist)")
    g.add_argument("--partition", default="iid", help="iid, dirichlet:ALPHA, shards:K, quantity:SIGMA or natural")
    g.add_argument("--examples-per-client", type=count, help="keep at most this many of each client's examples")
    g.add_argument("--model", default="mlp", help="mlp or cnn, as the coordinator's")
    g.add_argument("--val-fraction", type=probability, default=0.1, help="share of a client's data kept for "
                                                                       "federated evaluation")
    g = section(p, "simulation")
    g.add_argument("--slow-fraction", type=probability, default=0.0, help="share of clients that are slow")
    g.add_argument("--slow-step-delay", type=non_negative, default=0.05, help="extra seconds per step when slow")
    g.add_argument("--drop-probability", type=probability, default=0.0,
                   help="chance per client per round of vanishing before it uploads")
    g.add_argument("--trace", help="system traces, 'fedscale' (generated from --seed) or a CSV/JSON file: speeds, "
                                   "links and availability per client (simulations/traces.py)")
    g.add_argument("--seats", type=count, default=4, help="sampled clients training at once in this process")
    g.add_argument("--seed", type=int, default=0, help="the seed of the data split (the same in every process)")
    g.add_argument("--device", default="cpu", help=f"where the clients train: {DEVICE_HELP}")


def run(args: argparse.Namespace) -> int:
    """Host this process's slice until the coordinator says training is over."""
    import torch

    from fedpar.client.reconnect import FatalAgentError
    from fedpar.datasets import load_dataset
    from fedpar.datasets.clientdata import client_parts
    from fedpar.datasets.registry import full_dataset_name
    from fedpar.parallel.device import flush_denormals
    from fedpar.parallel.init import init_distributed, shutdown_distributed
    from fedpar.simulations.population import PopulationHost, PopulationSlice, step_delays
    from fedpar.task import Partition
    from fedpar.tasks.zoo import classifier_for
    from fedpar.simulations.traces import traces_for

    setup_logging(args)
    torch.set_num_threads(1)
    flush_denormals()
    info = init_distributed(device="cpu")  # rank and world size from torchrun; the group is only for numbering
    try:
        dataset = full_dataset_name(args.dataset, args.clients)
        splits = load_dataset(dataset, args.data_dir)
        parts = client_parts(splits, args.partition, args.clients, args.seed, args.examples_per_client)
        traces = traces_for(args.trace, args.clients, args.seed)
        delays = step_delays(args.clients, args.slow_fraction, args.slow_step_delay, args.seed, traces)
        mine = list(range(info.rank, args.clients, info.world_size))
        population = PopulationSlice.of(f"host-{info.rank}-of-{info.world_size}", mine, parts, delays,
                                        args.drop_probability, traces)
        task = classifier_for(args.model, splits, dataset, args.examples_per_client)

        def partition_of(number: int, member: str) -> Partition:
            return Partition(number, args.clients, member, args.partition, args.seed, args.val_fraction)

        stats = PopulationHost(args.server, population, task, partition_of, args.seed, args.seats,
                               device=args.device, max_backoff=args.max_backoff,
                               give_up_after=args.give_up_after).run()
    except ValueError as exc:
        print(f"fedpar simulate-workers: {exc}", file=sys.stderr)
        return 2
    except FatalAgentError as exc:  # refused, or unreachable for --give-up-after
        print(f"fedpar simulate-workers: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown_distributed()
    tasks, sent = sum(s.tasks for s in stats), sum(s.accepted for s in stats)
    print(f"rank {info.rank}/{info.world_size}: {len(mine)} clients hosted, {tasks} tasks run, {sent} updates sent")
    return 0
