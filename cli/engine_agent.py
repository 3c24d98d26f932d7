"""``fedpar client --nproc N`` (or under torchrun): one agent made of N ranks that train on the parallel engine.

Rank 0 runs the ordinary agent loop against the coordinator; every rank trains its shard of the agent's data
with FSDP/DDP/TP (client/engine_trainer.py); the other ranks leave when the coordinator says shutdown. The agent
trains ``--task`` (its model, loss, optimizer and client data) or the zoo's classifier for --model/--dataset.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from functools import partial

from fedpar.cli.agent_setup import agent_config, agent_data, agent_task, id_taken_line
from fedpar.cli.declared import add_declared, from_args
from fedpar.cli.log_level import setup_logging
from fedpar.cli.renamed import add_replicas_renamed
from fedpar.cli.user_errors import agent_exit_code, say_agent_interrupted
from fedpar.client.stats import AgentStats
from fedpar.parallel.config import ConfigurationError, Launch, ParallelConfig, ParallelLayout
from fedpar.settings import setting
from fedpar.task import raised
from fedpar.wording import counted


@dataclass
class EngineOptions:
    """What only a large-model agent sets."""

    idle_timeout: float = setting(7 * 86400.0, check="seconds", group="engine",
                                  help="seconds ranks other than 0 wait for the next task before giving up")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The large-model options of ``fedpar client`` (degrees multiply to --nproc, or torchrun's world size), in its
    "large-model agent" help section."""
    add_declared(p, Launch, group="engine")
    add_declared(p, ParallelConfig, only=("dp", "fsdp", "tp"), group="engine")
    add_replicas_renamed(p)
    add_declared(p, EngineOptions)


def wants_engine(args: argparse.Namespace) -> bool:
    """True when the options (or a torchrun environment) ask for a multi-rank agent."""
    p = _parallel_config(args)
    return args.nproc > 1 or "WORLD_SIZE" in os.environ or any(d > 1 for d in (p.dp, p.fsdp, p.tp))


def _parallel_config(args: argparse.Namespace) -> ParallelConfig:
    return from_args(ParallelConfig, args, sequence_parallel=False)


def _check_ranks_asked(p: ParallelConfig) -> None:
    """ConfigurationError, in one line, for degrees above 1 given to a one-rank launch (no --nproc, no torchrun)."""
    degrees = {"--dp-replicate": p.dp, "--fsdp": p.fsdp, "--tp": p.tp}
    asked = {flag: d for flag, d in degrees.items() if d > 1}
    if asked:
        ranks = math.prod(asked.values())
        flags = " ".join(f"{flag} {d}" for flag, d in asked.items())
        raise ConfigurationError(f"{flags}: an agent of {ranks} ranks, but --nproc is 1; add --nproc {ranks} (or "
                                 "launch the agent under torchrun)")


STOP_GRACE_SECONDS = 5.0  # how long a stopped launch waits for rank 0 to say what the agent did before killing it
LAUNCH_VARS = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


def check_launch_env(command: str) -> int:
    """The world size torchrun's variables give this process; ConfigurationError, in one line, when they are set
    by hand and cannot make a group (left in a shell after a torchrun session, or half-set in a job script)."""
    missing = [v for v in LAUNCH_VARS if v not in os.environ]
    fix = f"launch '{command}' with torchrun, or unset {', '.join(v for v in LAUNCH_VARS if v in os.environ)}"
    if missing:
        raise ConfigurationError(f"WORLD_SIZE is set in the environment but {', '.join(missing)} "
                                 f"{'is' if len(missing) == 1 else 'are'} not; {fix}")
    try:
        world, rank, port = (int(os.environ[v]) for v in ("WORLD_SIZE", "RANK", "MASTER_PORT"))
    except ValueError:
        raise ConfigurationError("WORLD_SIZE, RANK and MASTER_PORT must be whole numbers, but the environment has "
                                 + ", ".join(f"{v}={os.environ[v]!r}" for v in LAUNCH_VARS) + f"; {fix}") from None
    if not 0 <= rank < world or not 0 < port < 65536:
        raise ConfigurationError(f"the environment's RANK={rank}, WORLD_SIZE={world}, MASTER_PORT={port} make no "
                                 f"group (RANK must be 0 to WORLD_SIZE - 1, MASTER_PORT 1 to 65535); {fix}")
    return world


def join_failure(exc: RuntimeError, timeout: float) -> str:
    """The line for a process group this rank could not join (``exc`` from init_distributed)."""
    import torch.distributed as dist

    if not isinstance(exc, dist.DistError):  # already one line: e.g. rank 0 cannot listen on MASTER_PORT
        return str(exc)
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    return (f"rank {os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')}: the other ranks did not all meet at "
            f"{where} within {timeout:g} s; start every rank (torchrun on each node, the same --nnodes, "
            "--master-addr and --master-port), or unset WORLD_SIZE for one process")


def run_engine(args: argparse.Namespace) -> int:
    """Check the degrees, then run this process as one rank (torchrun) or spawn ``--nproc`` local ranks."""
    import torch

    from fedpar.cli.tlsopts import client_security
    from fedpar.client.engine_trainer import check_engine_task
    from fedpar.parallel.device import check_device_layout
    from fedpar.parallel.init import exit_rank_process, rank_start_method, spawn
    from fedpar.parallel.rank_failure import RankFailed, ranks_said_in_one_line
    from fedpar.parallel.stopping import exit_code, signal_name

    under_launcher = "WORLD_SIZE" in os.environ
    try:
        world = check_launch_env("fedpar client") if under_launcher else args.nproc
        if not under_launcher and world == 1:
            _check_ranks_asked(_parallel_config(args))
        if under_launcher and args.nproc not in (1, world):
            raise ConfigurationError(f"--nproc {args.nproc} but torchrun's WORLD_SIZE is {world}: drop --nproc under "
                                     "torchrun (its --nnodes and --nproc-per-node make the ranks)")
        if args.precision != "fp32":
            raise ConfigurationError("--precision bf16 is for single-process agents; a large-model agent trains "
                                     "in fp32 (drop --precision, or drop --nproc/--fsdp/--dp-replicate/--tp)")
        device_type = check_device_layout(args.device, int(os.environ.get("LOCAL_WORLD_SIZE", world))
                                          if under_launcher else world)
        layout = _parallel_config(args).resolved(world, device_type)  # once; every rank gets it as it is
        if not under_launcher:  # a task's mistakes, before any rank starts (torchrun's ranks check as they build)
            check_engine_task(agent_task(args), layout, world)
        if not under_launcher and not args.insecure:
            client_security(args)  # fail here, before spawning, on missing certificates
    except (ConfigurationError, ValueError) as exc:
        print(f"fedpar client: {exc}", file=sys.stderr)
        return 2
    if under_launcher:
        exit_rank_process(_torchrun_rank(args, layout))  # leaves without the teardown that can abort a gloo rank
    if world == 1:
        return engine_process(args, layout)
    options = {k: v for k, v in vars(args).items() if k != "_module"}
    # Rank 0 reports its exit code here rather than by exiting non-zero, which would make torch's spawn
    # terminate the other ranks while they are still leaving the group.
    # On a stop, rank 0 says what the agent did and sets it too: the launcher then says nothing more.
    method = rank_start_method()
    code = torch.multiprocessing.get_context(method).Value("i", 0)
    # Set once another rank failed, before the launch stops rank 0 with SIGTERM: rank 0 then says nothing (the launch
    # says which rank failed), not "interrupted" (QA: two lines, the first wrong, for one rank killed).
    lost = torch.multiprocessing.get_context(method).Value("i", 0)
    debug = _shows_tracebacks(args)
    try:
        with ranks_said_in_one_line(debug):  # Ctrl-C or SIGTERM here stops the ranks too (rank 0 first)
            spawn(world, _spawned, options, layout, code, lost, parent_stops=True, stop_grace=STOP_GRACE_SECONDS,
                  on_rank_lost=partial(setattr, lost, "value", 1), start_method=method)
    except KeyboardInterrupt as exc:  # LaunchStopped: SIGINT or SIGTERM to this process (or its group)
        if not code.value:  # rank 0 did not say what the agent did
            said_nothing = getattr(exc, "rank_0_said_nothing", False)  # it had not started: no task yet
            say_agent_interrupted(AgentStats().summary() if said_nothing else None)
        return exit_code(signal_name(exc))  # 130, 143: the signal this process was sent
    except RankFailed as failed:
        print(f"fedpar client: rank {failed.rank} of agent {args.agent_id} {failed.what}, which stops the agent; "
              f"start it again{'' if failed.signal_name else ' (--debug shows where)'}", file=sys.stderr)
        return 1
    except Exception as exc:  # --debug: torch's exception holds the rank's whole traceback as text
        print(f"fedpar client: {exc}", file=sys.stderr)
        return 1
    return code.value


def _torchrun_rank(args: argparse.Namespace, layout: ParallelLayout) -> int:
    """This process as one rank of a torchrun launch: its exit code, a failure said in one line (its traceback only
    with --debug), as a spawned rank's failure is said by its launcher."""
    try:
        return engine_process(args, layout)
    except KeyboardInterrupt:  # a terminal's Ctrl-C reaches every rank: one line per machine, from its local rank 0
        if os.environ.get("LOCAL_RANK", "0") != "0":
            return 130
        raise
    except Exception as exc:
        if _shows_tracebacks(args):
            raise
        print(f"fedpar client: rank {os.environ.get('RANK')} of agent {args.agent_id} failed: {raised(exc)}",
              file=sys.stderr)
        return 1


def _shows_tracebacks(args: argparse.Namespace) -> bool:
    """Whether a rank's failure is shown with its traceback (--debug, or --log-level debug) rather than one line."""
    return bool(getattr(args, "debug", False)) or args.log_level == "debug"


def _spawned(options: dict, layout: ParallelLayout, code, lost) -> None:
    result = engine_process(argparse.Namespace(**options), layout, said=code, lost=lost)
    if result:
        code.value = result


def engine_process(args: argparse.Namespace, layout: ParallelLayout, said=None, lost=None) -> int:
    """One rank of the agent (``layout``: the launcher's, as it resolved it): build the sharded trainer; rank 0 runs
    the Agent, the others follow it. Rank 0 takes its launcher's stop (SIGTERM; SIGINT under torchrun) from its
    start: it says what the agent did, as a one-process agent does, sets ``said`` (a shared int: its launcher then
    says nothing more) and leaves at once with 130 or 143 (the launcher or torchrun stops the other ranks); a stop
    that comes once ``lost`` (a shared int) is set, when another rank failed, it does not say (its launcher does)."""
    from fedpar.parallel.init import exit_rank_process
    from fedpar.parallel.stopping import StopRequested, exit_code, signal_name, stop_on_signals

    if os.environ.get("RANK", "0") != "0":
        return _engine_rank(args, layout, None)
    driving: list = []  # the Agent, once rank 0 has one (its counts); then "said", once it said its last line
    try:
        with stop_on_signals(second_exits=False):  # the launcher escalates a second signal
            return _engine_rank(args, layout, driving)
    except StopRequested as exc:
        # not once the agent has said its own last line (a stop as its ranks leave), nor when another rank failed
        if len(driving) < 2 and not (lost is not None and lost.value):
            stats = driving[0].stats if driving else AgentStats()
            say_agent_interrupted(stats.summary())
        code = exit_code(signal_name(exc))
        if said is not None:
            said.value = code
        exit_rank_process(code)  # not the barrier or the group's teardown: the other ranks may be mid-task
        return code  # not reached


def _engine_rank(args: argparse.Namespace, layout: ParallelLayout, driving: list | None) -> int:
    """:func:`engine_process`'s rank; rank 0 (``driving``: where it puts its Agent) drives the agent."""
    import torch

    from fedpar.cli.tlsopts import client_security
    from fedpar.client.engine_trainer import EngineTrainer
    from fedpar.client.local_loop import member_seed
    from fedpar.parallel.device import flush_denormals
    from fedpar.parallel.init import init_distributed, shutdown_distributed

    setup_logging(args)
    flush_denormals()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        info = init_distributed(args.dist_timeout, args.device)
    except RuntimeError as exc:  # torchrun's variables set by hand, for ranks that never came
        print(f"fedpar client: {join_failure(exc, args.dist_timeout)}", file=sys.stderr)
        return 2
    try:
        try:
            security = client_security(args) if info.is_main else None
            task = agent_task(args)
            trainer = EngineTrainer(task, agent_data(args, task), info, layout, seed=args.seed,
                                    idle_timeout_seconds=args.idle_timeout,
                                    data_seed=member_seed(args.seed, args.agent_id))  # as a simulated member's
        except ValueError as exc:  # every rank fails the same way on bad options or data: one line per machine
            if info.local_rank == 0:
                print(f"fedpar client: {exc}", file=sys.stderr)
            return 2
        if info.is_main:
            code = _drive(args, trainer, agent_config(args, security), task.name, info.world_size, driving)
        else:
            trainer.follow()
            code = 0
        # Leave together: rank 0 hosts the rendezvous store (see parallel/run.py).
        torch.distributed.barrier()
        return code
    finally:
        shutdown_distributed()


def _drive(args: argparse.Namespace, trainer, config, task_name: str, world: int, driving: list | None = None) -> int:
    """Rank 0: the ordinary agent loop over the engine trainer, then release the other ranks whatever happened
    (``driving``: where its Agent is put, for its counts on a stop)."""
    from fedpar.client.agent import Agent, FatalAgentError
    from fedpar.client.links import IdTaken

    agent = Agent(config, trainer)
    if driving is not None:
        driving.append(agent)
    print(f"agent {args.agent_id}: {counted(trainer.num_examples, 'training example')} of {task_name} over {world} ranks, "
          f"dialing {args.server}", flush=True)
    # Any other exception ends this process; the other ranks then fail fast on the closed connection.
    try:
        stats = agent.run()
    except FatalAgentError as exc:  # raised between tasks, so the other ranks are waiting for a command
        print(id_taken_line(exc.reason) if isinstance(exc, IdTaken) else f"fedpar client: {exc}", file=sys.stderr)
        trainer.shutdown()
        return 1
    trainer.shutdown()
    print(f"agent {args.agent_id}: {stats.summary()}", flush=True)
    if driving is not None:
        driving.append("said")
    return agent_exit_code(args.agent_id, stats)
