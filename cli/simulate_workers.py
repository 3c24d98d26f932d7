"""Host a slice of a virtual population against a running coordinator (`fedpar serve --accept-populations`),
one slice per process of a torchrun (or srun) launch, on one machine or many:

    torchrun --nnodes M --nproc-per-node P -m fedpar simulate-workers --server HOST:PORT --clients N ...

Every process joins torch.distributed's group (rendezvous and rank numbering are torchrun's), builds the same
data and partition from the seed, and hosts clients rank, rank + world, ...: a client runtime
(client/runtime.py) given simulations/population.py's members. The
coordinator samples, times and folds; it must be started with --min-available N to wait for the whole population.
Each host dials it over mutual TLS under its own certificate (``--certs DIR``: DIR/host-RANK-of-WORLD.pem, made by
``fedpar certs --agents host-0-of-2,host-1-of-2``; its members ride on the host's connection), or in plaintext with
``--insecure``, as ``fedpar client`` does.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from fedpar.cli.agent_setup import Connection
from fedpar.cli.declared import add_declared, section
from fedpar.cli.engine_agent import check_launch_env, join_failure
from fedpar.cli.log_level import setup_logging
from fedpar.cli.tlsopts import AgentTlsOptions, TlsFileOptions, client_security
from fedpar.datasets.settings import DataFiles, DataSource, Partitioning
from fedpar.parallel.config import ConfigurationError, Device, Precision
from fedpar.sections import Seeded
from fedpar.simulations.config import WAITING_SEATS, Population

LOG_LEVEL = "warning"
# what every host must be told alike: each deals itself a share of the population these describe
POPULATION_SETTINGS = ("clients", "seed", "dataset", "partition", "examples_per_client", "val_fraction", "model",
                       "trace", "trace_day_seconds", "slow_fraction", "slow_step_delay", "drop_probability")
JOIN_SECONDS = 300.0  # how long the hosts wait for one another in torch.distributed's group


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``fedpar simulate-workers``, generated from the sections it shares with ``fedpar simulate`` (the
    population, its data and device) and ``fedpar client`` (the connection)."""
    for key in ("connection", "tls", "data", "simulation"):
        section(p, key)
    add_declared(p, Connection)
    add_declared(p, TlsFileOptions)
    add_declared(p, AgentTlsOptions)
    add_declared(p, Population, required=("clients",))
    add_declared(p, DataSource)
    add_declared(p, DataFiles)
    add_declared(p, Partitioning)
    add_declared(p, Seeded)
    add_declared(p, Device)
    add_declared(p, Precision)


def run(args: argparse.Namespace) -> int:
    """Host this process's slice until the coordinator says training is over."""
    import numpy as np
    import torch

    from fedpar.cli.task_options import task_label
    from fedpar.client.links import FatalAgentError, IdTaken
    from fedpar.datasets import load_dataset
    from fedpar.datasets.members import member_source
    from fedpar.datasets.registry import full_dataset_name
    from fedpar.parallel.device import check_device_layout, flush_denormals
    from fedpar.parallel.init import init_distributed, shutdown_distributed
    from fedpar.parallel.stopping import stop_on_signals
    from fedpar.simulations.runner import worker_devices
    from fedpar.simulations.population import PopulationSlice, host_population, step_delays
    from fedpar.task import Partition
    from fedpar.tasks.zoo import classifier_for
    from fedpar.simulations.traces import check_day_seconds, traces_for

    setup_logging(args)
    torch.set_num_threads(1)
    flush_denormals()
    try:
        if "WORLD_SIZE" in os.environ:
            check_launch_env("fedpar simulate-workers")
        info = init_distributed(JOIN_SECONDS, device="cpu")  # rank and world size from torchrun; only for numbering
    except ConfigurationError as exc:
        print(f"fedpar simulate-workers: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # torchrun's variables set by hand, for ranks that never came
        print(f"fedpar simulate-workers: {join_failure(exc, JOIN_SECONDS)}", file=sys.stderr)
        return 2
    try:
        if (differ := population_mismatch(args, info.rank, info.world_size)) is not None:
            if info.is_main:  # it sees every host's settings; the others leave without a word
                print(f"fedpar simulate-workers: {differ}", file=sys.stderr)
            return 2
        check_device_layout(args.device)
        check_day_seconds(args.trace_day_seconds)
        # This machine's hosts are dealt over its GPUs, as simulate deals its worker processes.
        local_rank, local_world = (int(os.environ.get(k, d)) for k, d in (("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 1)))
        device = worker_devices(args.device, local_world)[local_rank]
        dataset = full_dataset_name(args.dataset, args.clients)
        splits = load_dataset(dataset, args.data_dir)
        members = member_source(splits, args.partition, args.clients, args.seed, args.examples_per_client)
        traces = traces_for(args.trace, args.clients, args.seed)
        delays = step_delays(args.clients, args.slow_fraction, args.slow_step_delay, args.seed, traces)
        mine = np.arange(info.rank, args.clients, info.world_size)
        host_id = f"host-{info.rank}-of-{info.world_size}"
        security = host_security(args, host_id, info.world_size)
        population = PopulationSlice.of(host_id, mine, members.sizes, delays, args.drop_probability, traces)
        task = classifier_for(args.model, splits, dataset, args.examples_per_client)

        def partition_of(number: int, member: str) -> Partition:
            return Partition(number, args.clients, member, args.partition, args.seed, args.val_fraction)

        seats = min(args.seats or WAITING_SEATS, max(1, len(mine)))  # more would wait idle (10^12 hung the host)
        runtime = host_population(args.server, population, task, partition_of, args.seed, seats,
                                  device=device, precision=args.precision, day_seconds=args.trace_day_seconds,
                                  max_backoff=args.max_backoff, give_up_after=args.give_up_after,
                                  tls=security.files, tls_server_name=security.server_name,
                                  enrollment_token=security.enrollment_token,
                                  task_name=task_label(argparse.Namespace(task=None, model=args.model,
                                                                          dataset=args.dataset)),
                                  whole_population=args.clients)
        runtime.say_outages_at(logging.WARNING)  # this command shows warnings only: a lost coordinator is still said
        with stop_on_signals():  # SIGTERM too leaves the coordinator (its round stops waiting for our members)
            stats = runtime.run()
    except ValueError as exc:
        print(f"fedpar simulate-workers: {exc}", file=sys.stderr)
        return 2
    except IdTaken as exc:  # the same rank launched twice: the one running keeps its place
        print(f"fedpar simulate-workers: rank {info.rank} of {info.world_size}: {exc.reason}; each simulate-workers "
              "process needs its own rank (its own torchrun --node-rank), or stop the other one first",
              file=sys.stderr)
        return 1
    except FatalAgentError as exc:  # refused, or unreachable for --give-up-after
        print(f"fedpar simulate-workers: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown_distributed()
    # one write, newline included: local ranks share their node's stdout, and an unbuffered print writes the
    # newline on its own (PYTHONUNBUFFERED), so two ranks' lines could run together
    sys.stdout.write(f"rank {info.rank}/{info.world_size}: {len(mine)} clients hosted, {stats.tasks} tasks run, "
                     f"{stats.accepted} updates sent\n")
    return 0


def population_mismatch(args: argparse.Namespace, rank: int, world_size: int) -> str | None:
    """What another host of the launch was told about the population that this one (rank 0) was not, in one line;
    None when every host agrees (collective). Each host deals itself members of the population its own settings
    describe, so hosts that disagree leave clients unhosted (a coordinator waiting for all of them waits forever)."""
    import hashlib

    import torch
    import torch.distributed as dist

    if world_size == 1:
        return None
    rest = repr([getattr(args, k) for k in POPULATION_SETTINGS if k not in ("clients", "seed")])
    digest = int.from_bytes(hashlib.sha256(rest.encode()).digest()[:7], "big")
    mine = torch.tensor([args.clients, args.seed, digest], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    for other, theirs in enumerate(every):
        if torch.equal(theirs, every[0]):
            continue
        said = [f"--{flag} {theirs[i].item()} where rank 0 has --{flag} {every[0][i].item()}"
                for i, flag in enumerate(("clients", "seed")) if theirs[i] != every[0][i]]
        return (f"the hosts disagree on the population: rank {other} was given "
                f"{', '.join(said) or 'other population settings than rank 0'}; start every node's torchrun with "
                f"the same {', '.join('--' + k.replace('_', '-') for k in POPULATION_SETTINGS)}")
    return None


def host_security(args: argparse.Namespace, host_id: str, world_size: int):
    """The host's TLS set-up (client_security with the host's id); a TlsSetupError that names the certificates a
    launch of ``world_size`` hosts needs when one is missing."""
    from fedpar.security.tls import TlsSetupError

    try:
        return client_security(args, host_id=host_id)
    except TlsSetupError as exc:
        said = str(exc)
        if said.startswith("TLS is required"):
            said = "TLS is required"
        elif "does not exist" in said:
            said = said.split(";")[0]
        else:
            raise
        hosts = ",".join(f"host-{rank}-of-{world_size}" for rank in range(min(world_size, 4)))
        more = ",..." if world_size > 4 else ""
        folder = args.certs or "certs"
        raise TlsSetupError(f"{said}; each host needs its own certificate: make them with 'fedpar certs --out "
                            f"{folder} --agents {hosts}{more}' and pass '--certs {folder}', or pass '--insecure' for "
                            f"plaintext (only on a network you trust)") from None
