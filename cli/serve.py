"""Run the coordinator: agents dial in, rounds run; with --checkpoint-dir (or --state: each run's, in PATH.runs/ID)
the global model is checkpointed every round.

Writes OUT/metrics.jsonl and metrics.csv (one line per round), and at the end the global model, OUT/global.safetensors
with OUT/global.json, then OUT/summary.json, accuracy.png and loss.png as `fedpar simulate` does; after Ctrl-C the
model and summary.json only (no plots: Ctrl-C stops within 2 s). With --checkpoint-dir it resumes after a restart.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fedpar.cli.compression_options import add_compression_arguments, compression_from_args
from fedpar.cli.config import chose
from fedpar.cli.declared import add_declared, from_args, said_with_flags, section
from fedpar.cli.flower_app_refusals import flower_app_refusal
from fedpar.cli.log_level import setup_logging
from fedpar.cli.observability import add_observability_arguments, check_metrics_endpoint, check_tensorboard_folder, \
    metrics_port_kept
from fedpar.cli.privacy import add_privacy_arguments, privacy_on, privacy_strategy
from fedpar.cli.renamed import add_negated_key
from fedpar.cli.serve_once import serve_once
from fedpar.cli.serve_service import ServiceOptions, check_distinct_ports
from fedpar.cli.strategy_options import add_strategy_arguments, strategy_options_from_args
from fedpar.cli.task_options import load_task_from_args
from fedpar.cli.tlsopts import add_tls_arguments, server_security
from fedpar.cli.user_errors import check_output_folder, check_port_free, check_rank_ports, describe
from fedpar.datasets.settings import DataFiles, DataSource
from fedpar.parallel.config import Device
from fedpar.parallel.stopping import StopRequested, exit_code, signal_name, stop_on_signals
from fedpar.protocol.heap import freeze_startup_heap
from fedpar.sections import Output, Plots
from fedpar.server.config import CoordinatorConfig
from fedpar.settings import redefault, setting
from fedpar.simulations.run_outputs import check_run_files
from fedpar.task import FlowerAppReference, TaskReference

if TYPE_CHECKING:
    from fedpar.server.assembly import CoordinatorAssembly

# Seconds rank 0 of a multi-rank coordinator gets, once signalled, to end the round, finish the checkpoint under
# way and write the summary and the model, before its launcher kills it.
STOP_GRACE_SECONDS = 10.0


@dataclass
class ServeOptions(Output, Plots):
    """What only ``fedpar serve`` sets: where it listens and writes, and the model it serves without data."""

    out: str = redefault(Output, "out", "runs/serve")
    host: str = setting("127.0.0.1", check="host", group="coordinator",
                        help="address to listen on (0.0.0.0 for every interface)")
    port: int = setting(50051, check="port", group="coordinator", help="port to listen on (0 picks a free one)")
    port_file: Path | None = setting(None, check="file_to_write", group="coordinator",
                                     help="once listening, write the bound port to this file (handy with --port 0)")
    params: int = setting(1_000_000, check="count", group="data",
                          help="with --model synthetic: a model of about this many float32 parameters and no data or "
                               "central evaluation, for benchmarks and load tests")
    central_eval: bool = setting(True, group="data",
                                 help="evaluate the global model on the server-side test set every round "
                                      "(--no-central-eval skips it)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``fedpar serve``, generated from the sections it is composed of (CoordinatorConfig's, the data,
    task, device, strategy, compression, privacy, TLS and observability sections, and ServeOptions)."""
    for key in ("coordinator", "outputs", "data", "device", "rounds", "training"):
        section(p, key)
    add_declared(p, ServeOptions, only=("host", "port", "port_file"))
    add_declared(p, ServiceOptions)
    add_declared(p, DataSource)
    add_declared(p, DataFiles)
    add_declared(p, TaskReference)
    add_declared(p, FlowerAppReference)
    options = add_declared(p, ServeOptions, skip=("host", "port", "port_file"))
    add_negated_key(options["central_eval"], "no_central_eval")
    add_declared(p, Device)
    add_strategy_arguments(p, "serve")
    add_declared(p, CoordinatorConfig)
    add_compression_arguments(p)
    add_privacy_arguments(p, population_flag=True)
    add_tls_arguments(p, "serve")
    add_observability_arguments(p)


@dataclass
class ServePlan:
    """What ``fedpar serve`` checked and built before listening."""

    config: CoordinatorConfig
    security: object
    assembly: CoordinatorAssembly
    strategy: object


def _plan(args: argparse.Namespace, rank: int = 0) -> ServePlan:
    """Settings, security, model and strategy from ``args`` (ValueError saying what to fix); ranks other than 0
    keep no metrics, checkpoints or central evaluation."""
    from fedpar.aggregation import build_strategy
    from fedpar.aggregation.compatibility import check_composition, options_privacy
    from fedpar.datasets import load_dataset
    from fedpar.parallel.device import resolve_device
    from fedpar.server.assembly import CoordinatorAssembly, synthetic_model
    from fedpar.server.secure_round import check_secure_setup

    config = from_args(CoordinatorConfig, args)
    config.metrics_path = Path(args.out) / "metrics.jsonl" if rank == 0 else None
    if rank:
        config.checkpoint_dir = None
        config.data_port = config.data_port + rank if config.data_port else 0
    # first: a missing certificate should not wait for data loading; said once, by the ranks' launcher if any
    security = server_security(args, warn=not getattr(args, "launcher_warned", False))
    config.upload_compression = compression_from_args(args)
    config.validate()
    strategy_options = strategy_options_from_args(args)
    task = load_task_from_args(args)
    eval_device = None if not args.central_eval or rank else resolve_device(args.device)
    if args.flower_app:  # --strategy with --flower-app: fedpar drives the app's ClientApps from its model
        from fedpar.tasks.flower_app import load_flower_app
        assembly = CoordinatorAssembly.for_flower_app(load_flower_app(args.flower_app, args.run_config), args.seed)
    elif task is not None:
        assembly = CoordinatorAssembly.for_task(task, args.seed, eval_device)
    elif args.model == "synthetic":
        assembly = CoordinatorAssembly(*synthetic_model(args.params, args.seed),
                                       description={"model": "synthetic", "params": args.params, "seed": args.seed})
    else:
        splits = load_dataset(args.dataset, args.data_dir)
        assembly = CoordinatorAssembly.for_data(args.model, splits, args.seed, eval_device)
        assembly.description["dataset"] = args.dataset
    if privacy_on(args) and config.fraction is not None:
        raise ValueError("--privacy needs a fixed cohort: use --clients-per-round instead of --fraction")
    name, options = privacy_strategy(args, args.strategy, config.clients_per_round, config.overselect,
                                     args.privacy_population)
    check_composition(name, config.secure_aggregation, config.upload_compression.method, config.max_agent_share,
                      options_privacy(options))
    strategy = build_strategy(name, **strategy_options, **options)
    strategy.check_ranks(_world(args))
    if config.secure_aggregation:
        check_secure_setup(assembly.names, assembly.weights, strategy)
    if config.max_agent_share is not None:  # before any checkpoint is read: say what is wrong, not "resume"
        strategy.cap_shares(config.max_agent_share)
    return ServePlan(config, security, assembly, strategy)


def _world(args: argparse.Namespace) -> int:
    """Aggregator ranks: torchrun's WORLD_SIZE when launched by it, else --aggregator-ranks."""
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else args.aggregator_ranks


def _check_rank_devices(args: argparse.Namespace) -> None:
    """ConfigurationError unless each aggregator rank on this machine gets a device: NCCL takes a GPU per rank."""
    from fedpar.parallel.device import check_device_layout

    check_device_layout(args.device, int(os.environ.get("LOCAL_WORLD_SIZE", _world(args))))


def run(args: argparse.Namespace) -> int:
    """Serve until every round is done (in ``--aggregator-ranks`` local processes when more than one); the service
    (--state) until a signal, which stops it cleanly whenever it comes."""
    if _is_service(args) and "WORLD_SIZE" not in os.environ:  # under torchrun, rank 0 says how it stopped
        try:
            with stop_on_signals():
                return _run(args)
        except KeyboardInterrupt as exc:  # before its ranks started or its own handling was in place, or after
            print(f"fedpar service: stopped by {signal_name(exc)}", flush=True)
            return 0
    return _run(args)


def _is_service(args: argparse.Namespace) -> bool:
    """Whether ``args`` run the long-lived service (--state), not a Flower ServerApp (which refuses --state)."""
    return args.state is not None and not _server_app_drives(args)


def _server_app_drives(args: argparse.Namespace) -> bool:
    """Whether a Flower app's ServerApp drives the rounds (--flower-app without --strategy), not fedpar's strategy."""
    return bool(args.flower_app) and not chose(args, "strategy")


def _run(args: argparse.Namespace) -> int:
    """What :func:`run` does, inside the service's handling of signals where it has one."""
    from fedpar.parallel.device import flush_denormals

    setup_logging(args)
    flush_denormals()
    try:
        _check_rank_devices(args)
    except ValueError as exc:
        print(f"fedpar serve: {exc}", file=sys.stderr)
        return 2
    server_app_drives = _server_app_drives(args)
    untaken = flower_app_refusal(args, server_app_drives)  # e.g. --lr, which the ServerApp's Messages do not carry
    if untaken:
        print(f"fedpar serve: {untaken}", file=sys.stderr)
        return 2
    if _is_service(args):  # a ServerApp's run refuses --state below, in one line
        return _serve_runs(args)
    check_output_folder(args.out)
    check_run_files(args.out)
    if args.tensorboard:  # said before a port is bound, as simulate and train say it
        check_tensorboard_folder(args.tensorboard)
    if args.checkpoint_dir is not None:  # before a port is bound or a model built
        from fedpar.server.checkpoint import CheckpointError, check_checkpoint_dir
        try:
            check_checkpoint_dir(args.checkpoint_dir)
        except CheckpointError as exc:
            print(f"fedpar serve: {exc}", file=sys.stderr)
            return 2
    if "WORLD_SIZE" not in os.environ:  # under torchrun each rank binds its own port
        check_distinct_ports(args)
        check_port_free(args.host, args.port)
        check_port_free(args.host, args.data_port, "--data-port")
        check_metrics_endpoint(args)
        check_rank_ports(args.host, args.port, args.aggregator_ranks, {p: o for p, o in (
            (args.data_port, "--data-port"), (args.metrics_port, "--metrics-port")) if p})
    if args.run_config and not args.flower_app:
        print("fedpar serve: --run-config needs --flower-app", file=sys.stderr)
        return 2
    if server_app_drives:  # the app's ServerApp drives the rounds
        from fedpar.cli.serve_flower_app import serve_flower_app
        with stop_on_signals():
            return serve_flower_app(args)
    try:
        plan = _plan(args)
    except ValueError as exc:
        print(f"fedpar serve: {said_with_flags(str(exc), args, CoordinatorConfig)}", file=sys.stderr)
        return 2
    world = _world(args)
    if world > 1 and "WORLD_SIZE" not in os.environ:
        from fedpar.server.ranks.memory import check_aggregator_ranks_fit
        try:  # each rank builds the model again: a huge N is said here, not by the kernel's OOM killer
            check_aggregator_ranks_fit(world, sum(w.size for w in plan.assembly.weights))
        except ValueError as exc:
            print(f"fedpar serve: {exc}", file=sys.stderr)
            return 2
        return _spawn_ranks(args, world)
    if world > 1:  # one rank of a torchrun-launched group
        _torchrun_rank(args)
    freeze_startup_heap()  # a service runs for weeks: each round's garbage cycles are freed (protocol/heap.py)
    with stop_on_signals():
        return serve_once(args, plan)


def _serve_runs(args: argparse.Namespace) -> int:
    """The long-lived form (--state), on one aggregator rank or several."""
    from fedpar.cli.serve_service import run_service

    world = _world(args)
    if world > 1 and "WORLD_SIZE" not in os.environ:  # the state file and certificates are checked before
        return run_service(args, _plan, launch_ranks=lambda: _spawn_ranks(
            args, world, {"state_lock_held": True, "launcher_says_stopped": True}))
    if world > 1:
        _torchrun_rank(args)
    return run_service(args, _plan)


def _torchrun_rank(args: argparse.Namespace) -> None:
    """Serve as one rank of a torchrun-launched group, and leave."""
    from fedpar.parallel.init import exit_rank_process

    serve_rank(args)
    exit_rank_process(0)  # a finished rank leaves without the teardown that can abort (parallel/init.py)


def _spawn_ranks(args: argparse.Namespace, world: int, more: dict | None = None) -> int:
    """Serve in ``world`` local aggregator rank processes (``more``: options only they get); the exit code."""
    from torch.multiprocessing import ProcessExitedException

    from fedpar.parallel.init import LaunchStopped, rank_start_method, spawn

    # Forked ranks skip the interpreter's start and torch's import: most of a restart's time. Not forked from a run
    # service (--state): its launcher may have served gRPC already, which does not survive a fork.
    method = rank_start_method(may_fork=args.state is None)
    # rank 0 started again serves the endpoint a scraper was pointed at (--metrics-port 0: one port for every start)
    ranks_ports = range(args.port, args.port + world) if args.port else ()
    try:
        with metrics_port_kept(args, avoid=ranks_ports) as metrics_port:
            spawn(world, serve_rank, {**plain_options(args), "launcher_warned": True, "metrics_port": metrics_port,
                                      **(more or {})},
                  parent_stops=True,
                  stop_grace=STOP_GRACE_SECONDS, rank_0_decides=True,  # rank 0 goes on without a lost rank
                  start_method=method,
                  # and when it dies, every rank starts again where the agents find it: the same port
                  # (a service's runs keep checkpoints; its operators find it on the same control port)
                  rank_0_resumes=(args.checkpoint_dir is not None or args.state is not None) and bool(args.port)
                  and (args.state is None or bool(args.control_port)))
    except KeyboardInterrupt as exc:  # SIGINT or SIGTERM: rank 0 wrote what completed, and said so
        if args.state is not None:  # a service ends cleanly by signal; run() names the one the user sent
            raise
        if isinstance(exc, LaunchStopped) and exc.rank_0_said_nothing:  # stopped as it started (spawned ranks)
            print("fedpar serve: interrupted", file=sys.stderr)
        return exit_code(signal_name(exc))
    except Exception as exc:  # a rank died or hung: the others were stopped with it
        if isinstance(exc, ProcessExitedException) and exc.error_index == 0 and exc.exit_code > 0:
            return exc.exit_code  # rank 0 ended by itself, and said why in its own line
        resume = ("; run the same command again to resume after the last checkpointed round"
                  if args.checkpoint_dir is not None or args.state is not None else "")  # else nothing to resume
        print(f"fedpar serve: {_rank_failure(exc)}{resume}", file=sys.stderr)
        return 1
    if args.state is not None:  # rank 0 of a service ends by itself only when signalled, and leaves the line here
        print("fedpar service: stopped by a signal to its rank 0", flush=True)
    return 0


def _rank_failure(exc: BaseException) -> str:
    """What went wrong in a spawned aggregator rank: its RankMissing or RankMessageError line when it raised one, else
    the line its traceback ends on or how it ended (parallel/rank_failure.py), else the launcher's first line."""
    from torch.multiprocessing import ProcessExitedException
    from torch.multiprocessing.spawn import ProcessRaisedException

    from fedpar.parallel.rank_failure import rank_failure
    from fedpar.server.ranks.group import first_line

    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = [line.split(f"{name}: ", 1)[1] for line in lines
            for name in ("RankMissing", "RankMessageError") if f"{name}: " in line]
    if said:
        return f"an aggregator rank failed: {said[0]}"
    if isinstance(exc, (ProcessRaisedException, ProcessExitedException)):
        return f"aggregator {rank_failure(exc)}"
    return f"an aggregator rank failed: {first_line(exc)}"


def plain_options(args: argparse.Namespace) -> dict:
    """The parsed options a spawned rank needs (values only: no handlers or modules), and which of them the user
    gave, typed or in a --config file (cli/config.py chose and typed; its notes said: ``_noted``)."""
    return {k: v for k, v in vars(args).items()
            if isinstance(v, (str, int, float, bool, Path, list, tuple, dict, frozenset, type(None)))}


def serve_rank(args: argparse.Namespace | dict) -> None:
    """One aggregator rank (spawned here, or launched by torchrun): rank 0 serves as the coordinator."""
    if isinstance(args, dict):
        args = argparse.Namespace(**args)
    from fedpar.parallel.device import flush_denormals
    from fedpar.parallel.init import exit_rank_process, shutdown_distributed

    setup_logging(args)
    flush_denormals()
    rank = int(os.environ.get("RANK", "0"))
    try:
        # rank 0 takes the launcher's stop from its start (the launcher (spawn, torchrun) escalates): one that comes
        # before its run could say what completed is said here
        with stop_on_signals(second_exits=False) if rank == 0 else contextlib.nullcontext():
            code = _serve_as(rank, args)
    except StopRequested:
        if rank > 0:
            code = 0  # the launcher stops a rank > 0 (rank 0 went, or the service ends): it holds nothing to write
        else:
            if args.state is None:  # a service's launcher names the signal itself
                print("fedpar serve: interrupted", file=sys.stderr)
            raise
    finally:
        shutdown_distributed()
    if code:
        exit_rank_process(code)


def _serve_as(rank: int, args: argparse.Namespace) -> int:
    """Aggregator rank ``rank``'s part (rank 0: the coordinator, or the service); its exit code."""
    from fedpar.server.ranks.group import launched_group

    if args.state is not None:  # a service: each run's parts are built as it starts
        timeout, plan = from_args(CoordinatorConfig, args).aggregator_timeout_seconds, None
    else:
        plan = _plan(args, rank)
        timeout = plan.config.aggregator_timeout_seconds
    group = launched_group(timeout, args.device)  # or a lost rank's replacement
    freeze_startup_heap()  # a service runs for weeks: each round's garbage cycles are freed (protocol/heap.py)
    advertised = "" if args.host in ("0.0.0.0", "::", "") else args.host
    if rank == 0:
        try:
            return _lead(args, plan, group, advertised)
        except OSError as exc:  # a full disk, a folder made read-only: the line cli/main.py would say
            print(f"fedpar serve: {describe(exc)}", file=sys.stderr)
            return 1
    if plan is None:  # a service's: each run rank 0 announces, until a signal ends it
        from fedpar.cli.serve_ranks import follow_runs
        return follow_runs(args, group, lambda options: _serve_ingest(options, _plan(options, rank), group, advertised))
    return _serve_ingest(args, plan, group, advertised)  # a signal ends it: it holds nothing rank 0 does not


def _lead(args: argparse.Namespace, plan: ServePlan | None, group, advertised: str) -> int:
    """Rank 0: the service (``plan`` None) or the one run, with the other ranks."""
    from fedpar.server.ranks.leader import RankLeader

    if plan is None:
        from fedpar.cli.serve_ranks import ServiceRanks
        from fedpar.cli.serve_service import run_service
        return run_service(args, _plan, rank_group=ServiceRanks(group, advertised))
    return serve_once(args, plan, RankLeader(group, advertised, plan.security.files))


def _serve_ingest(args: argparse.Namespace, plan: ServePlan, group, advertised: str) -> int:
    """Aggregator rank > 0: serve the agents rank 0 deals here until rank 0 says the rounds are done."""
    from fedpar.parallel.restarts import left_out_exit_code
    from fedpar.server.app import CoordinatorServer
    from fedpar.server.ranks.ingest import IngestRank

    ingest = IngestRank(plan.config, plan.assembly.names, plan.assembly.weights, plan.strategy, group,
                        admission=plan.security.admission, advertised_host=advertised,
                        control_tls=plan.security.files)
    port = args.port + group.rank if args.port else 0
    server = CoordinatorServer(ingest, host=args.host, port=port, credentials=plan.security.credentials,
                               data_tls=plan.security.data_tls)
    server.serve_to_end()
    return left_out_exit_code() if ingest.left_out else 0  # a rank left out is replaced by its launcher
