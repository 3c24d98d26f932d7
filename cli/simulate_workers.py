"""Host a slice of a virtual population against a running coordinator (`fedpar serve --accept-populations`),
one slice per process of a torchrun (or srun) launch, on one machine or many:

    torchrun --nnodes M --nproc-per-node P -m fedpar simulate-workers --server HOST:PORT --clients N ...

Every process joins torch.distributed's group (rendezvous and rank numbering are torchrun's), builds the same
data and partition from the seed, and hosts clients rank, rank + world, ... (simulations/population.py). The
coordinator samples, times and folds; it must be started with --min-available N to wait for the whole population.
"""

from __future__ import annotations

import argparse
import logging
import sys

from fedpar.cli.argtypes import count, non_negative, probability
from fedpar.parallel.device import DEVICE_HELP


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``fedpar simulate-workers``."""
    p.add_argument("--server", required=True, help="the coordinator, HOST:PORT (plaintext: loopback or a private "
                                                   "network; members have no certificates of their own)")
    p.add_argument("--clients", type=count, required=True, help="the whole population, over every process")
    p.add_argument("--dataset", default="digits", help="digits, mnist, synthetic:ALPHA:BETA, npz:PATH or csv:PATH")
    p.add_argument("--data-dir", help="folder with the MNIST files (for --dataset mnist)")
    p.add_argument("--partition", default="iid", help="iid, dirichlet:ALPHA, shards:K, quantity:SIGMA or natural")
    p.add_argument("--examples-per-client", type=count, help="keep at most this many of each client's examples")
    p.add_argument("--model", default="mlp", help="mlp or cnn, as the coordinator's")
    p.add_argument("--val-fraction", type=probability, default=0.1, help="share of a client's data kept for "
                                                                       "federated evaluation")
    p.add_argument("--slow-fraction", type=probability, default=0.0, help="share of clients that are slow")
    p.add_argument("--slow-step-delay", type=non_negative, default=0.05, help="extra seconds per step when slow")
    p.add_argument("--drop-probability", type=probability, default=0.0,
                   help="chance per client per round of vanishing before it uploads")
    p.add_argument("--trace", help="system traces, 'fedscale' (generated from --seed) or a CSV/JSON file: speeds, "
                                   "links and availability per client (simulations/traces.py)")
    p.add_argument("--seats", type=count, default=4, help="sampled clients training at once in this process")
    p.add_argument("--seed", type=int, default=0, help="the seed of the data split (the same in every process)")
    p.add_argument("--device", default="cpu", help=f"where the clients train: {DEVICE_HELP}")


def run(args: argparse.Namespace) -> int:
    """Host this process's slice until the coordinator says training is over."""
    import torch

    from fedpar.datasets import load_dataset
    from fedpar.datasets.clientdata import client_parts
    from fedpar.datasets.registry import full_dataset_name
    from fedpar.parallel.device import flush_denormals
    from fedpar.parallel.init import init_distributed, shutdown_distributed
    from fedpar.simulations.population import PopulationHost, PopulationSlice, step_delays
    from fedpar.simulations.traces import traces_for

    logging.basicConfig(level=logging.WARNING)
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
        stats = PopulationHost(args.server, population, splits, args.model, args.val_fraction, args.seed,
                               args.seats, device=args.device).run()
    except ValueError as exc:
        print(f"fedpar simulate-workers: {exc}", file=sys.stderr)
        return 2
    finally:
        shutdown_distributed()
    tasks, accepted = sum(s.tasks for s in stats), sum(s.accepted for s in stats)
    print(f"rank {info.rank}/{info.world_size}: {len(mine)} clients hosted, {tasks} tasks run, {accepted} accepted")
    return 0
