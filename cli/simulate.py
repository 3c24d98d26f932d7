"""Run a federation on this machine: a real coordinator and worker processes hosting N clients, on loopback gRPC.

Writes OUT/metrics.jsonl (one JSON object per round) and, at the end, the final global model (OUT/global.safetensors
with OUT/global.json), OUT/summary.json, OUT/accuracy.png and OUT/loss.png (after Ctrl-C: the model and summary.json,
no plots); prints a per-round table while it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from fedpar.cli.compression_options import add_compression_arguments, compression_from_args
from fedpar.cli.config import ignored_given
from fedpar.cli.declared import add_declared, from_args, said_with_flags, section
from fedpar.cli.flower_app_refusals import flower_app_refusal
from fedpar.cli.observability import Observers, add_observability_arguments, check_metrics_endpoint, \
    metrics_port_kept
from fedpar.cli.privacy import PRIVACY_COLUMNS, add_privacy_arguments, privacy_on, privacy_strategy
from fedpar.cli.progress import CLOCK_COLUMNS, COLUMNS, LiveBar, RoundTable
from fedpar.cli.renamed import add_retired
from fedpar.cli.strategy_options import add_strategy_arguments, strategy_options_from_args
from fedpar.cli.log_level import setup_logging
from fedpar.cli.task_options import check_nothing_replaced, check_task_options, task_options
from fedpar.cli.user_errors import UserError, check_output_folder, describe, hold_output_folder, run_exit_code
from fedpar.parallel.stopping import alive, stop_on_signals
from fedpar.settings import setting
from fedpar.simulations.config import SimulationConfig
from fedpar.simulations.run_outputs import check_run_files


LOG_LEVEL = None  # --log-level: none unless asked for (Python shows warnings)


@dataclass
class SimulateOptions:
    """What only ``fedpar simulate``'s command line sets."""

    quiet: bool = setting(False, group="outputs", help="print only the summary")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``fedpar simulate``: SimulationConfig's sections (it passes them to the coordinator and the
    workers as they are), the compression, privacy and observability sections, and SimulateOptions."""
    for key in ("rounds", "data", "training", "simulation"):
        section(p, key)
    add_strategy_arguments(p, "simulate")
    # --flower-app without --strategy: the app's ServerApp drives (simulations/flower_app_run.py); None tells it apart
    p.set_defaults(strategy=None)
    declared = add_declared(p, SimulationConfig, skip=("strategy", "strategy_options"),
                            defaults={"out": "runs/simulation"})
    declared["clients"].default = argparse.SUPPRESS  # unset when not given: a Flower App's num-supernodes may stand in
    add_declared(p, SimulateOptions)
    add_compression_arguments(p)
    add_privacy_arguments(p, population_flag=False)
    add_observability_arguments(p)
    add_retired(p, "--virtual-clients", "is the default now (worker processes host the population; only sampled "
                                        "clients get a model and data); drop it")


def simulation_config(args: argparse.Namespace, say: bool = True) -> SimulationConfig:
    """The settings the options describe, settled (:meth:`SimulationConfig.settled`): with ``say``, one line on
    stderr for each that asked for more clients than there are, saying what is used instead."""
    check_nothing_replaced(args)
    check_task_options(args)
    cfg, notes = from_args(SimulationConfig, args, task_options=task_options(args),
                           upload_compression=compression_from_args(args)).settled()
    for note in notes if say else ():
        print(f"fedpar simulate: {note}", file=sys.stderr)
    return cfg


def run(args: argparse.Namespace) -> int:
    """Run the simulation and print the summary: in a child process (:func:`launch`) when there are other aggregator
    ranks or a checkpoint folder, else in this one."""
    from fedpar.tasks.flower_app import quiet_flower_logs

    check_output_folder(args.out)
    check_run_files(args.out)
    if args.checkpoint_dir is not None:  # before --out is made or a worker started
        from fedpar.server.checkpoint import CheckpointError, check_checkpoint_dir
        try:
            check_checkpoint_dir(args.checkpoint_dir)
        except CheckpointError as exc:
            print(f"fedpar simulate: {exc}", file=sys.stderr)
            return 2
    try:
        held = hold_output_folder(args.out)
    except UserError as exc:  # another run writes there
        print(f"fedpar simulate: {exc}", file=sys.stderr)
        return exc.exit_code
    flower = bool(args.flower_app) or (args.strategy or "").startswith("flower:")
    with held, quiet_flower_logs(args.quiet and flower):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """:func:`run`, with --out held for this run and Flower's lines quieted with --quiet."""
    check_metrics_endpoint(args)
    server_app_drives = bool(args.flower_app) and args.strategy is None
    args.strategy = args.strategy or "fedavg"
    try:
        if args.flower_app:
            flower_app_clients(args)
        cfg = simulation_config(args)
    except ValueError as exc:  # settings no simulation can run, e.g. a compression knob out of its range
        print(f"fedpar simulate: {setting_error(exc, args)}", file=sys.stderr)
        return 2
    untaken = flower_app_refusal(args, server_app_drives)  # e.g. --lr, which the ServerApp's Messages do not carry
    if untaken:
        print(f"fedpar simulate: {untaken}", file=sys.stderr)
        return 2
    if server_app_drives:
        if ignored_given(args, {"rounds": "the Flower App's ServerApp decides its rounds"}):  # it counts its own
            from fedpar.tasks.flower_app import ROUNDS_HINT
            print(f"fedpar simulate: --rounds: the Flower App's ServerApp decides its rounds, so fedpar cannot apply "
                  f"it; drop it, or {ROUNDS_HINT}, or add --strategy NAME to let fedpar drive the app's ClientApps",
                  file=sys.stderr)
            return 2
        if privacy_on(args):  # the ServerApp aggregates as it likes: a user who asked for DP must not get none
            print("fedpar simulate: --privacy: the Flower App's ServerApp decides aggregation, so fedpar cannot make "
                  "it private; add --strategy NAME to let fedpar drive the app's ClientApp (with DP), or drop "
                  "--privacy", file=sys.stderr)
            return 2
        return run_server_app(args, cfg)
    launched = cfg.aggregator_ranks > 1 or cfg.checkpoint_dir is not None  # a lost rank 0 is said, or resumed
    if launched:
        return launch_checked(args, cfg)
    from fedpar.simulations.worker_processes import WorkerProcesses, preloaded_dataset

    try:
        preload = preloaded_dataset(cfg)
    except ValueError as exc:  # the dataset's name (synthetic:1): no worker started
        print(f"fedpar simulate: {setting_error(exc, args)}", file=sys.stderr)
        return 2
    # Before the coordinator's set-up, which their data loading (and, spawned, their imports) overlaps.
    return simulate(args, cfg, WorkerProcesses(cfg.workers, preload, cfg.data_dir))


def launch_checked(args: argparse.Namespace, cfg: SimulationConfig) -> int:
    """:func:`launch`, once the strategy and every setting are checked here (a refusal, or what a resume changes,
    is said before the child starts); none when the checkpoint has every round done and --out its outputs (said).
    The checkpoint folder is locked first, and until the run ends (across the child's restarts): a second run there
    is refused before it reads the first's checkpoints."""
    global _held
    from fedpar.server.checkpoint import lock_folder

    made = cfg.checkpoint_dir if cfg.checkpoint_dir is not None and not Path(cfg.checkpoint_dir).exists() else None
    started = False
    try:
        _held = lock_folder(cfg.checkpoint_dir) if cfg.checkpoint_dir is not None else None
        with_strategy(args, cfg)
        from fedpar.simulations.runner import check_settings
        for line in check_settings(cfg):
            print(f"fedpar simulate: {line}", file=sys.stderr)
        if cfg.aggregator_ranks > 1:  # as serve's: a huge N is said here, not by the kernel's OOM killer
            from fedpar.server.ranks.memory import check_aggregator_ranks_fit
            # the model is built from the data in the child: its ranks' copies of it are not counted here
            check_aggregator_ranks_fit(cfg.aggregator_ranks, advice="give a smaller --aggregator-ranks")
        started = True
    except ValueError as exc:
        print(f"fedpar simulate: {setting_error(exc, args)}", file=sys.stderr)
        return 2
    finally:
        if not started:  # refused (here, or by the command, e.g. a ConfigError)
            _let_go(made)
    from fedpar.simulations.resume import nothing_to_do

    try:
        if nothing_to_do(cfg):  # no worker, coordinator or child process starts only to find every round done
            return 0
        return launch(args, cfg)
    finally:
        _let_go(made)


_held = None  # the checkpoint folder's lock (server/checkpoint.lock_folder) this launcher holds for its run


def _let_go(made: str | None = None) -> None:
    """Release the checkpoint folder's lock; ``made``: the folder, when this run made it: taken away if the lock
    is all it holds (a refused start, here or in the child)."""
    global _held
    if _held is None:
        return
    from fedpar.server.checkpoint import LOCK

    try:
        bare = made is not None and [p.name for p in Path(made).iterdir()] == [LOCK]
    except OSError:  # the folder is gone: nothing to take away
        bare = False
    _held.release(refused=bare)
    _held = None
    if bare:
        with contextlib.suppress(OSError):
            Path(made).rmdir()


def setting_error(exc: ValueError, args: argparse.Namespace) -> str:
    """The line for a ValueError: a setting named as this command's flag (a task's own words left as they are)."""
    from fedpar.server.config import CoordinatorConfig
    from fedpar.task import TaskError

    return str(exc) if isinstance(exc, TaskError) else said_with_flags(str(exc), args, SimulationConfig,
                                                                        CoordinatorConfig)


def with_strategy(args: argparse.Namespace, cfg: SimulationConfig) -> None:
    """Give ``cfg`` the strategy and strategy options the options make (with privacy: its DP strategy); ValueError
    for options it cannot take."""
    cfg.strategy_options = strategy_options_from_args(args)
    cfg.strategy, options = privacy_strategy(args, cfg.strategy, cfg.clients_per_round or cfg.clients,
                                             cfg.overselect, cfg.clients)
    cfg.strategy_options.update(options)


def launch(args: argparse.Namespace, cfg: SimulationConfig) -> int:
    """Run the simulation in one child process, as `fedpar serve` runs its aggregator ranks (parallel/init.spawn):
    this process outlives it. When the child (the coordinator, rank 0 of the aggregator ranks) dies by a signal
    (``kill -9``, a crash), it is started again with a ``--checkpoint-dir`` (at most 3 times an hour) and resumes
    after the last checkpointed round; without one, one line says what happened. The exit code."""
    import torch
    from torch.multiprocessing import ProcessExitedException

    from fedpar.cli.serve import plain_options
    from fedpar.parallel.init import LaunchStopped, rank_start_method, spawn
    from fedpar.parallel.stopping import exit_code, signal_name
    options = {**plain_options(args), "coordinator_threads": torch.get_num_threads(), "launcher_pid": os.getpid()}
    try:
        # spawn's own block shares `received`; a child started again serves the same metrics endpoint
        with metrics_port_kept(args) as metrics_port, stop_on_signals() as received, _stops_told(received):
            spawn(1, simulate_here, {**options, "metrics_port": metrics_port}, parent_stops=True,
                  stop_grace=STOP_GRACE_SECONDS, start_method=rank_start_method(),
                  rank_0_resumes=cfg.checkpoint_dir is not None)
    except KeyboardInterrupt as exc:  # SIGINT or SIGTERM: the child wrote what completed, and said so
        if isinstance(exc, LaunchStopped) and exc.rank_0_said_nothing:  # stopped as it started (spawned ranks)
            print("fedpar simulate: interrupted", file=sys.stderr)
        return exit_code(signal_name(exc))
    except ProcessExitedException as exc:  # the child died: by a signal, or with an exit code after saying why
        if exc.exit_code > 0:
            return exc.exit_code
        print(f"fedpar simulate: the coordinator process was ended by {exc.signal_name} after round "
              f"{_rounds_written(cfg.out)}; {_how_to_go_on(cfg)}", file=sys.stderr)
        return 1
    return 0


STOP_GRACE_SECONDS = 60.0  # the child's time, once signalled, to write what completed (summary, model, plots)
TOLD_STOP = signal.SIGUSR2  # the child's word to its launcher: a SIGINT came to it (see _tell_launcher)
# ... and a SIGHUP came to it: a signal of its own, so that the launcher stops as for its own SIGHUP (exit 129); where
# there is no real-time signal (macOS) the child's SIGHUP is told as a SIGINT
TOLD_HANGUP = getattr(signal, "SIGRTMIN", TOLD_STOP)
TOLD = {signal.SIGINT: TOLD_STOP, signal.SIGHUP: TOLD_HANGUP}  # what the child ignores otherwise: the word it sends


@contextlib.contextmanager
def _stops_told(received):
    """In the launcher: the child's word (TOLD) stops the run as the signal it names does here, unless a stop is
    under way already (a Ctrl-C or a closed terminal reaches both processes: the child's word may come later than
    the launcher's own signal)."""
    meaning = {TOLD_HANGUP: signal.SIGHUP, TOLD_STOP: signal.SIGINT}  # one word for both (macOS): a SIGINT

    def told(signum, frame) -> None:
        if received.signal is None:
            signal.raise_signal(meaning[signum])  # ignored here too where this process ignores it (nohup)

    previous = {s: signal.signal(s, told) for s in meaning}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _tell_launcher(launcher: int | None):
    """In the child (its launcher's pid: ``launcher``; None: no launcher, nothing changes): a SIGINT or SIGHUP, which
    the child otherwise ignores (its launcher stops it), is told to the launcher, which stops the run as for its own
    (`kill -INT` or `kill -HUP` of the child's pid, found by pgrep, stopped nothing)."""
    if launcher is None:
        yield
        return

    def tell(signum, frame) -> None:
        if alive(launcher):  # else the launcher is gone, and this process is stopping for that
            os.kill(launcher, TOLD[signum])

    previous = {s: signal.signal(s, tell) for s in TOLD}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _how_to_go_on(cfg: SimulationConfig) -> str:
    """What to do after the run stopped on a lost process."""
    return ("run the same command again to resume after the last checkpointed round" if cfg.checkpoint_dir else
            "simulate kept no checkpoint: run the same command again to start over, or give --checkpoint-dir DIR so "
            "that the run resumes by itself after such a loss")


def _rounds_written(out: str | None) -> int:
    """The last round OUT/metrics.jsonl holds (0: none), read from the file's end."""
    from fedpar.protocol.run_logs import lines_backward

    metrics = Path(out) / "metrics.jsonl" if out else None
    lines = lines_backward(metrics) if metrics is not None and metrics.exists() else ()
    return next((json.loads(line)["round"] for _, line in lines if line.strip()), 0)


def simulate_here(options: dict) -> None:
    """The simulation, in the child :func:`launch` starts: it ends the process with the exit code."""
    import torch

    from fedpar.parallel.init import exit_rank_process

    torch.set_num_threads(options.pop("coordinator_threads"))  # the launch set one, as for ranks sharing cores
    if _held is not None:  # forked: the launcher holds the lock; this copy of its file must not outlive it in workers
        _held.handle.close()
    args = argparse.Namespace(**options)
    if args.log_level:
        setup_logging(args)
    # SIGTERM here stops the run as in the launcher (not the default death, which the launcher would resume from)
    with stop_on_signals(), _tell_launcher(args.launcher_pid):
        code = _simulate_here(args)
    if code:
        exit_rank_process(code)


def _simulate_here(args: argparse.Namespace) -> int:
    """:func:`simulate` in the child, with its user mistakes said in one line; the exit code."""
    from fedpar.parallel.stopping import exit_code, signal_name

    try:
        cfg = simulation_config(args, say=False)  # the launcher said its notes
        return simulate(args, cfg)
    except (UserError, OSError) as exc:  # one line, as cli/main.py says it (--debug: the traceback)
        if args.debug:
            raise
        hint = "" if isinstance(exc, UserError) else " (--debug shows the traceback)"  # none for a user's mistake
        print(f"fedpar simulate: {describe(exc)}{hint}", file=sys.stderr)
        return exc.exit_code if isinstance(exc, UserError) else 1
    except KeyboardInterrupt as exc:  # stopped before the run could say what completed (as cli/main.py says it)
        print("fedpar simulate: interrupted", file=sys.stderr)
        return exit_code(signal_name(exc))


def simulate(args: argparse.Namespace, cfg: SimulationConfig, workers=None) -> int:
    """Run the simulation of ``cfg`` (its strategy not yet made: :func:`with_strategy`) here and print the summary;
    the exit code. ``workers``: its worker processes, started already (simulations/worker_processes.py); else the
    run starts them."""
    try:
        return _simulate(args, cfg, workers)
    finally:
        if workers is not None:
            workers.close(wait=False)  # the run closed them, unless it stopped before it took them


def _simulate(args: argparse.Namespace, cfg: SimulationConfig, workers) -> int:
    from fedpar.server.rounds import rank_columns
    from fedpar.simulations.run_outputs import RunOutputs
    from fedpar.server.members import TooFewMembers
    from fedpar.server.ranks.group import RankMissing
    from fedpar.simulations.runner import ProcessLost, TaskStopped, run_simulation

    columns = COLUMNS + (PRIVACY_COLUMNS if privacy_on(args) else []) + \
        (rank_columns(cfg.aggregator_ranks) if cfg.aggregator_ranks > 1 else []) + \
        (CLOCK_COLUMNS if cfg.virtual_clock else [])
    table = RoundTable(total=cfg.rounds, stream=sys.stdout, quiet=args.quiet, columns=columns)
    observers = Observers(args)
    progress = LiveBar(quiet=args.quiet, total=cfg.rounds, traced=bool(cfg.trace))
    try:
        with_strategy(args, cfg)
        callbacks = [progress.round_ended, table.row, *observers.round_callbacks()]
        with stop_on_signals() as stop, _tell_launcher(getattr(args, "launcher_pid", None)):
            # SIGINT or SIGTERM: what completed is written (a second: exit now)
            summary = run_simulation(cfg, on_round=lambda row: [f(row) for f in callbacks],
                                     on_server=observers.attach, on_progress=progress.follow,
                                     on_stage=progress.preparing, workers=workers)
    except ValueError as exc:  # a task's mistake (TaskFailed: its code raised as the run went on, exit 1), a setting
        print(f"fedpar simulate: {setting_error(exc, args)}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    except UserError as exc:  # a path the run cannot use (an --out it cannot make)
        print(f"fedpar simulate: {exc}", file=sys.stderr)
        return exc.exit_code
    except TooFewMembers as exc:  # every client is on this machine: the traces and --clients-per-round are to change
        print(f"fedpar simulate: {exc}", file=sys.stderr)
        return 2
    except TaskStopped:  # the worker said what failed, in one line
        return 2
    except (ProcessLost, RankMissing) as exc:  # a worker or an aggregator rank died: named, with no traceback
        progress.close()
        kept = exc.written if isinstance(exc, ProcessLost) else ()  # the rounds before it: rows, model, summary
        said = RunOutputs({}, list(kept)).wrote_line(cfg.out) if kept else f"its rows are in {cfg.out}/metrics.jsonl"
        print(f"fedpar simulate: {exc}; the run stopped after round {table.pace.last_round} ({said}); "
              f"{_how_to_go_on(cfg)}", file=sys.stderr)
        return 1
    finally:
        progress.close()
        observers.close()
    summary.pop("config", None)
    written = RunOutputs(summary, summary.pop("written"))
    print(json.dumps(summary, indent=2))
    print(written.wrote_line(cfg.out))
    return run_exit_code("fedpar simulate", summary, stop.signal, cfg.task)



def flower_app_clients(args: argparse.Namespace) -> None:
    """``--clients`` from the Flower App's default federation when not given (one line on stderr for what its
    federation says that is mapped or ignored); FlowerAppError (a ValueError) when no count can be told."""
    from fedpar.tasks.flower_app import load_flower_app

    federation = load_flower_app(args.flower_app, args.run_config).federation
    if federation is None:
        return
    clients, notes = federation.simulated_clients(getattr(args, "clients", None))
    for note in notes:
        print(f"fedpar simulate: {note}", file=sys.stderr)
    if clients is not None:
        args.clients = clients


def run_server_app(args: argparse.Namespace, cfg: SimulationConfig) -> int:
    """``--flower-app DIR`` without ``--strategy``: the app's ServerApp drives the run, watched as ``args`` asks
    (--metrics-port, --tensorboard); print the summary."""
    from fedpar.simulations.flower_app_run import run_flower_app
    from fedpar.simulations.run_outputs import RunOutputs
    from fedpar.tasks.flower_app import load_flower_app

    observers = None
    try:
        app = load_flower_app(cfg.flower_app, cfg.run_config)
        observers = Observers(args)
        with stop_on_signals() as stop:
            summary = run_flower_app(cfg, app, cfg.run_config, on_server=observers.watch)
    except (ValueError, RuntimeError) as exc:  # a setting it cannot honour, an app that cannot load, a lost worker,
        print(f"fedpar simulate: {exc}", file=sys.stderr)  # the ServerApp's failure (TaskFailed: exit 1)
        return getattr(exc, "exit_code", 2 if isinstance(exc, ValueError) else 1)
    except UserError as exc:  # an earlier run's file in --out that cannot be set aside, a --metrics-port taken since
        print(f"fedpar simulate: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        if observers is not None:
            observers.close()
    summary.pop("config", None)
    written = RunOutputs(summary, summary.pop("written"))
    print(json.dumps(summary, indent=2))
    print(written.wrote_line(cfg.out))
    return run_exit_code("fedpar simulate", summary, stop.signal)
