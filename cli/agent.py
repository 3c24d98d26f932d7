"""Run one client agent: it dials out to the coordinator (so it works behind NAT), trains on its own
data when sampled, stops in time for the deadline and uploads its update. Data never leaves it.

For demos, --partition/--num-partitions/--partition-index pick this agent's share of a dataset.
With --nproc N (or under torchrun) the agent is N ranks training with the parallel engine (--fsdp/--dp-replicate/--tp).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from fedpar.cli.agent_setup import Connection, agent_config, agent_data, agent_task, id_taken_line
from fedpar.cli.declared import add_declared, section
from fedpar.cli.engine_agent import add_engine_arguments, run_engine, wants_engine
from fedpar.cli.log_level import setup_logging
from fedpar.cli.renamed import add_negated_key
from fedpar.cli.task_options import check_nothing_replaced, check_task_options
from fedpar.cli.tlsopts import add_tls_arguments, client_security
from fedpar.cli.user_errors import agent_exit_code, say_agent_interrupted
from fedpar.datasets.settings import DataFiles, DataSource, Partitioning
from fedpar.parallel.config import ConfigurationError, Device, Precision
from fedpar.sections import Seeded
from fedpar.server.config import DATA_PLANE_HELP
from fedpar.settings import setting
from fedpar.task import FlowerAppReference, TaskReference
from fedpar.wording import counted


@dataclass
class AgentOptions:
    """What only ``fedpar client`` sets: who the agent is, its share of the data, and how it trains."""

    agent_id: str | None = setting(None, group="connection", help="this agent's unique name")
    poll_seconds: float = setting(5.0, check="seconds", flag="poll", group="connection",
                                  help="long-poll seconds per request")
    data_plane: bool = setting(True, group="connection", help=DATA_PLANE_HELP)
    flower_client: str | None = setting(
        None, group="data", metavar="MODULE:FN",
        help="train with a Flower NumPyClient: FN (package.module:fn or path/file.py:fn) takes a Flower Context "
             "(node_config: partition-id, num-partitions, agent-id) and returns the client; its arrays must match "
             "--model (needs pip install 'fedpar[flower]')")
    flower_examples: int | None = setting(
        None, check="count", group="data", metavar="N",
        help="with --flower-client: the client's training set size, told to the coordinator at join; unset: the "
             "client's get_properties()['num_examples']")
    num_partitions: int = setting(1, check="count", group="data", help="how many shares the training set is cut into")
    partition_index: int = setting(0, check="non_negative_int", group="data",
                                   help="which share is this agent's (0-based)")
    partition_seed: int = setting(0, check="seed", group="data",
                                  help="seed of the split (same on every agent)")
    threads: int | None = setting(None, check="threads", group="device", help="torch threads for local training")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``fedpar client``, generated from the sections it is composed of."""
    for key in ("connection", "data", "device"):
        section(p, key)
    add_declared(p, Connection)
    options = add_declared(p, AgentOptions, only=("agent_id", "poll_seconds", "data_plane"), required=("agent_id",))
    add_negated_key(options["data_plane"], "no_data_plane")
    add_declared(p, DataSource)
    add_declared(p, DataFiles)
    add_declared(p, TaskReference)
    add_declared(p, FlowerAppReference)
    add_declared(p, Partitioning)
    add_declared(p, Seeded)
    add_declared(p, AgentOptions, skip=("agent_id", "poll_seconds", "data_plane"))
    add_declared(p, Device)
    add_declared(p, Precision)
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


def flower_app_agent(args: argparse.Namespace, config):
    """The agent of ``--flower-app``: its one member (its partition, the app's run config) answers a ServerApp's
    Messages (fedpar serve --flower-app) and, when the app names its [tool.fedpar] model (whose arrays fedpar's
    strategies start from), trains under fedpar's strategies too."""
    from fedpar.client.flower_app_member import FlowerAppAgent, FlowerAppTrainer
    from fedpar.client.runtime import ClientRuntime
    from fedpar.tasks.flower_app import load_flower_app

    if args.flower_client or args.task:
        raise ValueError("--flower-app says what this agent trains: drop --flower-client and --task")
    check_nothing_replaced(args)  # the ClientApp loads its own data: a --dataset given beside it was ignored
    check_task_options(args)  # --task-option KEY=VALUE, a Flower user's run-config override: ignored
    app = load_flower_app(args.flower_app, args.run_config)
    initial = app.initial_arrays(args.seed) if app.fedpar_table.get("model") else None
    trainer = FlowerAppTrainer(app.client_app, app.run_config, initial)
    trainer.use_member(args.agent_id, args.partition_index, args.num_partitions,
                       app.train_examples(args.partition_index, args.num_partitions))
    return ClientRuntime(config, FlowerAppAgent(args.agent_id, trainer))


def run(args: argparse.Namespace) -> int:
    """Run the agent until the coordinator says shutdown."""
    import torch

    from fedpar.client.agent import Agent, FatalAgentError
    from fedpar.client.links import IdTaken
    from fedpar.client.flower_client import FlowerClientError
    from fedpar.client.local_loop import member_seed
    from fedpar.client.task_trainer import TaskTrainer
    from fedpar.parallel.device import check_device_layout, flush_denormals, resolve_device
    from fedpar.parallel.stopping import exit_code, signal_name, stop_on_signals

    setup_logging(args)
    flush_denormals()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not 0 <= args.partition_index < args.num_partitions:
        print(f"fedpar client: --partition-index {args.partition_index} is not below --num-partitions "
              f"{args.num_partitions}; give an index from 0 to {args.num_partitions - 1}", file=sys.stderr)
        return 2
    if args.run_config and not args.flower_app:
        print("fedpar client: --run-config needs --flower-app", file=sys.stderr)
        return 2
    if (args.flower_client or args.flower_app) and wants_engine(args):
        given, whose = ("--flower-app", "the Flower App's") if args.flower_app else ("--flower-client",
                                                                                  "the Flower client's")
        print(f"fedpar client: {given} trains with {whose} own code; --nproc and the engine options are for fedpar's "
              "own trainer: drop them", file=sys.stderr)
        return 2
    if wants_engine(args):
        return run_engine(args)
    try:
        check_device_layout(args.device)
        device = resolve_device(args.device)
        security = client_security(args)
        if args.flower_app:  # the ClientApp loads its own data; its arrays are the app's model's
            task, trainer = None, None
            agent = flower_app_agent(args, agent_config(args, security))
        elif args.flower_client:  # its arrays are checked against the task's model
            task = agent_task(args)
            trainer = flower_trainer(args, task.model())
        else:
            task = agent_task(args)
            # shuffled as the simulated member of this id and --seed is: `fedpar simulate` gives the same model
            trainer = TaskTrainer(task, agent_data(args, task), seed=member_seed(args.seed, args.agent_id),
                                  device=device, precision=args.precision)
    except (ConfigurationError, ValueError) as exc:  # a task's mistakes too (TaskError)
        print(f"fedpar client: {exc}", file=sys.stderr)
        return 2
    if not args.flower_app:
        agent = Agent(agent_config(args, security), trainer)
    where = f"Flower App {args.flower_app}" if args.flower_app else f"Flower client {args.flower_client}" \
        if args.flower_client else f"{counted(trainer.num_examples, 'training example')} of {task.name} on {device}"
    print(f"agent {args.agent_id}: {where}, dialing {args.server}", flush=True)
    try:
        with stop_on_signals():  # SIGTERM (systemd, Docker, kill) stops it as Ctrl-C does, and says so as Ctrl-C does
            stats = agent.run()
    except IdTaken as exc:  # the same --agent-id started twice: the one running keeps its place
        print(id_taken_line(exc.reason), file=sys.stderr)
        return 1
    except FatalAgentError as exc:
        print(f"fedpar client: {exc}", file=sys.stderr)
        return 1
    except (FlowerClientError, ValueError) as exc:  # a Flower fit's arrays that do not fit; a task hook's (TaskError)
        print(f"fedpar client: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: what it did so far, as serve and simulate say theirs
        say_agent_interrupted(agent.stats.summary())
        return exit_code(signal_name(exc))  # 130, 143
    print(f"agent {args.agent_id}: {stats.summary()}", flush=True)
    return agent_exit_code(args.agent_id, stats)
