"""Run one client agent: it dials out to the coordinator (so it works behind NAT), trains on its own
data when sampled, stops in time for the deadline and uploads its update. Data never leaves it.

For demos, --partition/--num-partitions/--partition-index pick this agent's share of a dataset.
With --nproc N (or under torchrun) the agent is N ranks training with the parallel engine (--fsdp/--dp-replicate/--tp).
"""

from __future__ import annotations

import argparse
import sys

from fedpar.cli.agent_setup import add_reconnect_arguments, agent_config, agent_partition, agent_task
from fedpar.cli.argtypes import count, non_negative_int, positive, probability
from fedpar.cli.declared import section
from fedpar.cli.engine_agent import add_engine_arguments, run_engine, wants_engine
from fedpar.cli.log_level import setup_logging
from fedpar.cli.task_options import add_task_arguments
from fedpar.cli.tlsopts import add_tls_arguments, client_security
from fedpar.parallel.config import DEVICE_HELP, PRECISIONS, ConfigurationError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``fedpar client``."""
    g = section(p, "connection")
    g.add_argument("--server", default="127.0.0.1:50051", help="coordinator address HOST:PORT")
    g.add_argument("--agent-id", required=True, help="this agent's unique name")
    g.add_argument("--poll", dest="poll_seconds", type=positive, default=5.0, help="long-poll seconds per request")
    add_reconnect_arguments(g)
    g.add_argument("--no-data-plane", action="store_true",
                   help="always move weights over the gRPC streams, even when the coordinator offers its data plane")
    g = section(p, "data")
    g.add_argument("--model", default="mlp", help="mlp or cnn; must match the coordinator's")
    g.add_argument("--flower-client", metavar="MODULE:FN",
                   help="train with a Flower NumPyClient: FN (package.module:fn or path/file.py:fn) takes a Flower "
                        "Context (node_config: partition-id, num-partitions, agent-id) and returns the client; its "
                        "arrays must match --model (needs pip install 'fedpar[flower]')")
    g.add_argument("--flower-examples", type=count, default=None, metavar="N",
                   help="with --flower-client: the client's training set size, told to the coordinator at join; "
                        "unset: the client's get_properties()['num_examples']")
    g.add_argument("--dataset", default="digits", help="digits or mnist")
    g.add_argument("--data-dir", help="folder with the MNIST files (for --dataset mnist)")
    add_task_arguments(p)
    g.add_argument("--partition", default="iid", help="iid, dirichlet:ALPHA or shards:N")
    g.add_argument("--num-partitions", type=count, default=1, help="how many shares the training set is cut into")
    g.add_argument("--partition-index", type=non_negative_int, default=0, help="which share is this agent's (0-based)")
    g.add_argument("--partition-seed", type=int, default=0, help="seed of the split (same on every agent)")
    g.add_argument("--val-fraction", type=probability, default=0.1, help="local share kept for federated evaluation")
    g.add_argument("--seed", type=int, default=0, help="seed for local shuffling")
    g = section(p, "device")
    g.add_argument("--threads", type=count, default=None, help="torch threads for local training")
    g.add_argument("--device", default="auto", help=DEVICE_HELP)
    g.add_argument("--precision", default="fp32", choices=PRECISIONS,
                   help="bf16: forward passes under bf16 autocast (weights and uploads stay fp32)")
    add_tls_arguments(p, "client")
    add_engine_arguments(p)


def flower_trainer(args: argparse.Namespace, model):
    """The trainer around the Flower client ``--flower-client`` makes, checked against ``model``'s arrays."""
    from fedpar.client.flower_client import FlowerTrainer, flower_context, load_flower_client
    from fedpar.models import weight_specs

    try:
        context = flower_context(args.agent_id, args.partition_index, args.num_partitions)
    except ImportError as exc:
        if (exc.name or "").split(".")[0] != "flwr":
            raise
        raise ValueError("--flower-client needs Flower: pip install 'fedpar[flower]'") from None
    return FlowerTrainer(load_flower_client(args.flower_client, context), weight_specs(model), args.flower_examples)


def run(args: argparse.Namespace) -> int:
    """Run the agent until the coordinator says shutdown."""
    import torch

    from fedpar.client.agent import Agent, FatalAgentError
    from fedpar.client.flower_client import FlowerClientError
    from fedpar.client.task_trainer import TaskTrainer
    from fedpar.parallel.device import check_device_layout, flush_denormals, resolve_device

    setup_logging(args)
    flush_denormals()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not 0 <= args.partition_index < args.num_partitions:
        print("fedpar client: --partition-index must be in [0, --num-partitions)", file=sys.stderr)
        return 2
    if args.flower_client and wants_engine(args):
        print("fedpar client: --flower-client trains with the Flower client's own code; --nproc and the engine "
              "options are for fedpar's trainer", file=sys.stderr)
        return 2
    if wants_engine(args):
        return run_engine(args)
    try:
        check_device_layout(args.device)
        device = resolve_device(args.device)
        security = client_security(args)
        task = agent_task(args)
        if args.flower_client:  # its arrays are checked against the task's model
            trainer = flower_trainer(args, task.model())
        else:
            trainer = TaskTrainer(task, task.client_data(agent_partition(args)), seed=args.seed, device=device,
                                  precision=args.precision)
    except (ConfigurationError, ValueError) as exc:  # a task's mistakes too (TaskError)
        print(f"fedpar client: {exc}", file=sys.stderr)
        return 2
    agent = Agent(agent_config(args, security), trainer)
    where = f"Flower client {args.flower_client}" if args.flower_client else \
        f"{trainer.num_examples} training examples of {task.name} on {device}"
    print(f"agent {args.agent_id}: {where}, dialing {args.server}", flush=True)
    try:
        stats = agent.run()
    except FatalAgentError as exc:
        print(f"fedpar client: {exc}", file=sys.stderr)
        return 1
    except (FlowerClientError, ValueError) as exc:  # a Flower fit's arrays that do not fit; a task hook's (TaskError)
        print(f"fedpar client: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(f"agent {args.agent_id}: {stats.tasks} tasks, {stats.accepted} updates accepted, "
          f"{stats.refused} refused", flush=True)
    return 0
