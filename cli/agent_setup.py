"""What the options of ``fedpar client`` describe, for the single-process agent (cli/agent.py) and each rank of a
large-model agent (cli/engine_agent.py): the task, this agent's share of its data, and the AgentConfig; and the
connection settings it shares with ``fedpar simulate-workers``, declared once."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from fedpar.cli.task_options import load_task_from_args, task_label
from fedpar.datasets.partition import AUTO
from fedpar.client.backoff import MAX_BACKOFF_SECONDS
from fedpar.settings import setting


@dataclass
class Connection:
    """Which coordinator a client process dials, and how it waits for one it cannot reach (client/links.py:
    agents' and simulation hosts')."""

    server: str = setting("127.0.0.1:50051", check="address", group="connection", metavar="HOST:PORT",
                          help="the coordinator's address")
    max_backoff: float = setting(MAX_BACKOFF_SECONDS, check="seconds", group="connection",
                                 help="longest wait between reconnection attempts")
    give_up_after: float | None = setting(None, check="seconds", group="connection",
                                          help="exit after this many seconds without reaching the coordinator "
                                               "(default: never)")


def id_taken_line(reason: str) -> str:
    """What ``fedpar client`` says when the coordinator refused it because another live process holds its id
    (``reason``: the coordinator's words)."""
    return f"fedpar client: {reason}; give each agent its own --agent-id, or stop the other one first"


def agent_task(args: argparse.Namespace):
    """The task this agent runs: --task, else the zoo's classifier for --model and --dataset."""
    from fedpar.tasks.zoo import classifier

    task = load_task_from_args(args)
    return task if task is not None else classifier(args.model, args.dataset, args.data_dir)


def agent_partition(args: argparse.Namespace):
    """This agent's share of the task's data, as --partition/--num-partitions/--partition-index say."""
    from fedpar.task import Partition

    return Partition(args.partition_index, args.num_partitions, args.agent_id, args.partition, args.partition_seed,
                     args.val_fraction)


def agent_data(args: argparse.Namespace, task):
    """``task``'s data for this agent's share (:func:`agent_partition`); a share the zoo's own data cannot give (a
    --num-partitions above its examples) is a ValueError naming the flags the user gave, not the zoo's task."""
    from fedpar.task import TaskError

    try:
        return task.data_for(agent_partition(args))
    except TaskError as exc:
        cause = exc.__cause__
        if args.task is not None or not isinstance(cause, ValueError):
            raise  # a user's task's own code: its words, and 'fix the task'
        # the partitioning's words count the shares as a federation's clients
        reason = str(cause).replace("use fewer clients", "give a smaller --num-partitions")
        reason = reason.replace("--clients", "--num-partitions")
        scheme = f" (--partition {args.partition})" if args.partition != AUTO else ""
        raise ValueError(f"--num-partitions {args.num_partitions}{scheme}: {reason}") from None


def agent_config(args: argparse.Namespace, security):
    """The AgentConfig the options and the TLS set-up describe."""
    from fedpar.client.agent import AgentConfig

    return AgentConfig(server=args.server, agent_id=args.agent_id, poll_seconds=args.poll_seconds,
                       max_backoff=args.max_backoff, give_up_after=args.give_up_after,
                       credentials=security.credentials, insecure=security.credentials is None,
                       tls_server_name=security.server_name,
                       enrollment_token=security.enrollment_token,
                       data_plane=getattr(args, "data_plane", True), data_tls=security.data_tls,
                       tls_files=security.files, task=task_label(args))
