"""Centralized training on the parallel engine: DDP, FSDP (HSDP), tensor/sequence and pipeline parallelism.

One process by default; --nproc N spawns N local ranks (gloo on CPU, NCCL on GPUs). Under torchrun
(RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set) every launched process is one rank, e.g.
`torchrun --nnodes 2 --nproc-per-node 8 ... -m fedpar train --model gpt --dataset text --fsdp 8 --tp 2 ...`.
Writes OUT/metrics.jsonl, OUT/summary.json, OUT/loss_curve.png, the final model (OUT/global.safetensors and
global.json, as `train --task` and federated runs keep it; a pipeline's stages gathered too) and (with
--checkpoint-every) resumable DCP checkpoints in OUT/checkpoints. --config FILE reads a [train] table and its
nested tables: [train.parallel] holds the parallel options (tp = 2 as --tp 2) and [train.model_kwargs] the model's
keywords; flags override. Layout errors (degrees, pipeline stages vs blocks, heads vs --tp, bf16 with nothing to
apply it) stop the launcher before any rank starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedpar.cli.config import chose
from fedpar.cli.declared import add_declared, from_args, section
from fedpar.cli.observability import add_observability_arguments
from fedpar.cli.progress import StepBar
from fedpar.cli.renamed import add_alias, add_replicas_renamed
from fedpar.cli.task_options import load_task_from_args, task_options
from fedpar.cli.user_errors import reader_left
from fedpar.datasets.registry import dataset_entry
from fedpar.datasets.settings import DataSource
from fedpar.parallel.config import ConfigurationError, Launch, ParallelConfig, TrainConfig
from fedpar.settings import setting
from fedpar.task import TaskError, TaskReference

if TYPE_CHECKING:
    from fedpar.simulations.run_outputs import EarlierRun


LOG_LEVEL = None  # --log-level: none unless asked for (Python shows warnings)


@dataclass
class TrainOptions:
    """What only ``fedpar train``'s command line sets."""

    model_arg: list[str] = setting(default_factory=list, append=True, group="data", metavar="KEY=VALUE",
                                   help="model constructor keyword, e.g. n_layer=4 or hidden=[256,128] (repeatable)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fedpar train``, generated from the sections it is composed of: TrainConfig's (data, device,
    seed, output, optimisation), the task, the launch, the parallel layout and TensorBoard."""
    for key in ("data", "device", "optimisation", "outputs"):
        section(parser, key)
    add_declared(parser, TrainConfig)
    add_declared(parser, TaskReference)
    add_declared(parser, TrainOptions)
    # No flag: a --config file's [train.model_kwargs] table lands here; --model-arg entries override it.
    parser.set_defaults(model_kwargs={})
    add_observability_arguments(parser, only=("tensorboard",))
    launch = add_declared(parser, Launch)
    add_alias(parser, "--timeout", launch["dist_timeout"])
    add_declared(parser, ParallelConfig)
    add_replicas_renamed(parser)


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig the parsed options describe."""
    kwargs: dict[str, Any] = dict(getattr(args, "model_kwargs", None) or {})
    for item in args.model_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigurationError(f"--model-arg {item!r} must look like KEY=VALUE, e.g. n_layer=4")
        kwargs[key.strip()] = _parse_value(value.strip())
    return from_args(TrainConfig, args, tensorboard=args.tensorboard, model_kwargs=kwargs,
                     parallel=from_args(ParallelConfig, args), model=_model_of(args))


def _model_of(args: argparse.Namespace) -> str:
    """--model, or when it is not given the model the dataset trains (gpt on --dataset text, else mlp)."""
    if chose(args, "model") or args.model != DataSource().model or getattr(args, "task", None):
        return args.model
    try:
        return dataset_entry(args.dataset).model
    except (TypeError, ValueError):  # an unknown name is said where the data loads, naming the valid ones
        return args.model


def run(args: argparse.Namespace) -> int:
    """Validate (layout, precision, model shape against the degrees), then train here or in ``--nproc`` ranks; SIGINT
    or SIGTERM stops it as Ctrl-C does (parallel/stopping.py): what completed is written, exit 128 + the signal."""
    from fedpar.parallel.stopping import stop_on_signals

    with stop_on_signals():  # a second signal while the interrupted run writes its summary: exit at once
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """What :func:`run` does, inside its handling of stop signals."""
    from fedpar.cli.observability import check_tensorboard_folder
    from fedpar.cli.user_errors import check_output_folder

    try:
        world = _world(args)
    except ConfigurationError as exc:  # torchrun's variables left in a shell, or half set
        print(f"fedpar train: {exc}", file=sys.stderr)
        return 2
    check_output_folder(args.out)
    _check_run_files(args)
    _check_checkpoint_folder(args)
    if args.tensorboard:  # a missing package, or a folder that cannot be made, is said before any rank starts
        check_tensorboard_folder(args.tensorboard)
    with _out_held(args.out) as held:
        try:
            return _train(args, world, held)
        except KeyboardInterrupt as exc:  # a stop once training began is said where it began (_launch, _launch_task)
            return _stopped_starting(args, exc)


def _stopped_starting(args: argparse.Namespace, exc: KeyboardInterrupt) -> int:
    """Say that the run was stopped in its start-up (settings, data, task, checkpoint checks), before any step, and
    what the same command will do; its exit code (128 + the signal)."""
    from fedpar.parallel.stopping import exit_code, signal_name

    if not int(os.environ.get("RANK", "0")):
        from fedpar.simulations.run_outputs import CHECKPOINT_POINTER

        pointer = Path(args.out) / CHECKPOINT_POINTER
        try:
            kept = pointer.read_text(errors="replace").strip() if pointer.is_file() else ""
        except OSError:
            kept = ""
        again = "the same command starts it again"
        if kept:
            again = (f"the same command resumes from its checkpoint {kept}" if args.resume else
                     f"the same command starts it afresh (without --no-resume it resumes from its checkpoint {kept})")
        print(f"fedpar train: interrupted while starting, before any step; wrote nothing to {args.out}; {again}",
              file=sys.stderr)
    return exit_code(signal_name(exc))


def _world(args: argparse.Namespace) -> int:
    """The world size: torchrun's, its variables checked (cli/engine_agent.py), else --nproc's."""
    from fedpar.cli.engine_agent import check_launch_env

    return check_launch_env("fedpar train") if "WORLD_SIZE" in os.environ else args.nproc


def _check_run_files(args: argparse.Namespace) -> None:
    """UserError, before any rank starts, when a folder is where the run writes one of its files in --out."""
    from fedpar.simulations.run_outputs import TRAIN_FILES, check_run_files

    check_run_files(args.out, tuple(name for name in TRAIN_FILES if args.plot or name != "loss_curve.png"))


def _check_checkpoint_folder(args: argparse.Namespace) -> None:
    """UserError, before any rank starts, when OUT/checkpoints, where --checkpoint-every keeps the checkpoints (of the
    zoo's models and of a --task), is a file or its pointer ``latest`` a folder: each rank failed at the first
    checkpoint; or when it is a federated run's."""
    from fedpar.cli.user_errors import UserError
    from fedpar.simulations.run_outputs import CHECKPOINT_POINTER

    folder = Path(args.out) / "checkpoints"
    if args.checkpoint_every and folder.exists() and not folder.is_dir():
        raise UserError(f"--checkpoint-every {args.checkpoint_every}: {folder}, where the checkpoints are kept, is a "
                        "file, not a folder; move it away, or give another --out")
    pointer = Path(args.out) / CHECKPOINT_POINTER
    if (args.checkpoint_every or args.resume) and pointer.is_dir():  # each rank failed at its first checkpoint
        raise UserError(f"{pointer} is a folder, but it must be the file that names the latest checkpoint in "
                        f"{folder}; move it away (or give another --out)")
    _check_not_federated(Path(args.out))


def _check_not_federated(out: Path) -> None:
    """UserError when ``out`` or OUT/checkpoints holds a federated run's checkpoints (`fedpar serve
    --checkpoint-dir`): this run's files beside them left serve refusing to resume that run."""
    from fedpar.cli.user_errors import UserError
    from fedpar.server.checkpoint import CheckpointError, latest_round

    for folder in (out, out / "checkpoints"):
        try:
            served = latest_round(folder) if folder.is_dir() else None
        except CheckpointError:  # already mixed with train's checkpoints, or its pointer unreadable: not serve's now
            served = None
        if served is not None:
            raise UserError(f"--out {out}: {folder} holds the checkpoints of a federated run (`fedpar serve "
                            f"--checkpoint-dir`, round {served}), not of `fedpar train`; give --out a folder of "
                            "its own")


def _out_held(out: str) -> contextlib.AbstractContextManager:
    """``out`` made and held for this run alone (a second run into it, or a folder that cannot be made or written, is
    one line: cli/user_errors.py), by the process that writes there: not by torchrun's other ranks. What a run killed
    there had set aside is put back first (EarlierRun.recover): its ``latest`` decides whether this run resumes."""
    from fedpar.cli.user_errors import hold_output_folder
    from fedpar.simulations.run_outputs import EarlierRun

    if int(os.environ.get("RANK", "0")):
        return contextlib.nullcontext()
    with hold_output_folder(out) as held:
        EarlierRun.recover(Path(out))
        return held.pop_all()


def _train(args: argparse.Namespace, world: int, held: contextlib.ExitStack | None) -> int:
    """What :func:`_run` does with ``--out`` held (``held``: rank 0's hold, None on the others), on ``world``
    ranks."""
    from fedpar.parallel.device import check_device_layout

    under_launcher = "WORLD_SIZE" in os.environ
    if args.task or args.task_options:
        return _train_task(args, world, held)
    try:
        # One GPU per rank on this machine: torchrun's LOCAL_WORLD_SIZE, else the ranks spawned here.
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if under_launcher else world
        cfg = config_from_args(args).resolved(world, check_device_layout(args.device, local_ranks))
        check_all_apply(args, cfg)
        # imported once the settings hold (torch.distributed.checkpoint: half a second a refusal need not wait for)
        from fedpar.parallel.checkpoint import check_resume, latest_checkpoint
        from fedpar.parallel.preflight import preflight

        # another layout, model or data said here, not by every rank (ranks torchrun started: no memory check)
        check_resume(cfg, preflight(cfg, 0 if under_launcher else world))
    except (ConfigurationError, ValueError, FileNotFoundError) as exc:  # data and model errors too
        print(f"fedpar train: {exc}", file=sys.stderr)
        return 2
    earlier = _earlier_outputs(cfg.out, cfg.resume and latest_checkpoint(Path(cfg.out) / "checkpoints") is not None)
    try:
        return _launch(args, cfg, world, earlier, held)
    finally:
        _settled(earlier)  # also after a failure: a run that wrote nothing loses nothing of the earlier one


def _launch(args: argparse.Namespace, cfg: TrainConfig, world: int, earlier: EarlierRun | None,
            held: contextlib.ExitStack | None) -> int:
    """Train ``cfg`` here or on ``world`` ranks; the command's exit code."""
    from fedpar.parallel.dcp_storage import UnsafeCheckpointError
    from fedpar.parallel.init import spawn
    from fedpar.parallel.rank_failure import RankFailed
    from fedpar.parallel.run import spawned_train_process, train_process

    under_launcher = "WORLD_SIZE" in os.environ
    started = time.perf_counter()
    try:
        if world > 1 and not under_launcher:  # the ranks get the layout resolved here, as it is
            _spawn_ranks(spawn, world, spawned_train_process, cfg, args)
        else:
            if under_launcher:
                _join_torchrun_group(cfg, args.dist_timeout)
            train_process(cfg, args.dist_timeout, StepBar())
            if under_launcher:
                _leave_finished_rank(earlier, held)
    except KeyboardInterrupt as exc:  # SIGINT or SIGTERM (to the launcher: the ranks are stopped): say what completed
        from fedpar.parallel.stopping import exit_code, signal_name
        if int(os.environ.get("RANK", "0")):
            return exit_code(signal_name(exc))
        from fedpar.parallel.metrics import write_interrupted_summary
        from fedpar.wording import counted
        kept_step = getattr(exc, "kept_step", None)  # set where the model of the last whole step was written
        summary = write_interrupted_summary(Path(cfg.out), cfg.model, cfg.dataset, world,
                                            time.perf_counter() - started, cfg.to_dict(), kept_step)
        from fedpar.simulations.run_outputs import RunOutputs

        steps = counted(kept_step, "step") if kept_step is not None else counted(summary["steps"], "logged step")
        written = [name for name in ("metrics.jsonl", "metrics.csv", "summary.json")
                   if (Path(cfg.out) / name).is_file()]
        written += ["global.safetensors", "global.json"] if kept_step is not None else []
        wrote = RunOutputs(summary, [] if _settled(earlier) else written).wrote_line(Path(cfg.out))
        print(f"fedpar train: interrupted after {steps}; {wrote}{_resume_hint(cfg)}", file=sys.stderr)
        return exit_code(signal_name(exc))
    except RankFailed as exc:  # not the user's settings (those are said before any rank starts): say which rank
        _raise_if_reader_left(exc)
        # a rank killed from outside (kill -9, out of memory) left no traceback; what the run can do next, as a stop
        print(f"fedpar train: {exc}{_resume_hint(cfg)}" if exc.signal_name else
              f"fedpar train: {exc} (--debug shows the traceback)", file=sys.stderr)
        return 1
    except UnsafeCheckpointError as exc:  # damaged where check_resume could not see it (in this process's rank)
        if args.debug:
            raise
        print(f"fedpar train: {exc}", file=sys.stderr)
        return 2
    return 0


def _join_torchrun_group(cfg: TrainConfig, timeout: float) -> None:
    """This torchrun rank in its group, before it trains (the training joins it then); UserError in one line when
    the ranks do not all meet (torchrun's variables set by hand, for ranks that never came)."""
    from fedpar.cli.engine_agent import join_failure
    from fedpar.cli.user_errors import UserError
    from fedpar.parallel.init import init_distributed

    try:
        init_distributed(timeout, cfg.device)
    except RuntimeError as exc:
        raise UserError(join_failure(exc, timeout)) from None


def _earlier_outputs(out: str, resumes: bool) -> EarlierRun | None:
    """The files an earlier run left in ``out``, set aside until this run writes (simulations/run_outputs.py); None
    when this run resumes a checkpoint (its rows go on, with those a killed run had set aside put back) or is not the
    rank that writes."""
    if int(os.environ.get("RANK", "0")):
        return None
    from fedpar.simulations.run_outputs import earlier_run_in

    return earlier_run_in(Path(out), resumes)


def _settled(earlier: EarlierRun | None) -> bool:
    """The earlier run's files let go once this run wrote (a logged step, or a model), else put back; whether they
    were put back (over what this run wrote of its own: it then left nothing)."""
    return earlier is not None and earlier.settle()


def _leave_finished_rank(earlier: EarlierRun | None, held: contextlib.ExitStack | None) -> None:
    """End a finished torchrun rank at once, without the teardown that can abort (parallel/init.py); on rank 0, the
    earlier run's files settled and --out's lock let go first, as leaving so skips every ``finally`` and ``with``."""
    from fedpar.parallel.init import exit_rank_process

    _settled(earlier)
    if held is not None:
        held.close()
    exit_rank_process(0)


def _resume_hint(cfg: TrainConfig) -> str:
    """What an interrupted run can do next: resume from its last checkpoint, or keep one next time."""
    from fedpar.parallel.checkpoint import latest_checkpoint

    try:
        latest = latest_checkpoint(Path(cfg.out) / "checkpoints")
    except ValueError:  # a damaged pointer is said when the run is resumed
        latest = None
    if latest is not None:  # this run's, or (put back) the earlier run's, which --no-resume did not take up
        again = "the same command" if cfg.resume else "the same command without --no-resume"
        return f"; {again} resumes from its checkpoint {latest.name}"
    if cfg.checkpoint_every:  # asked for, but stopped before the first: pointing at the option the user gave misled
        every = cfg.checkpoint_every
        return f"; nothing to resume from yet (--checkpoint-every {every} keeps the first at step {every})"
    return "; nothing to resume from (--checkpoint-every K keeps a checkpoint every K steps)"


def check_all_apply(args: argparse.Namespace, cfg: TrainConfig) -> None:
    """ConfigurationError naming each option the user typed that ``cfg``'s run would ignore, and what it needs to
    apply; one only a --config file set is said in a note (cli/config.py ignored_given)."""
    from fedpar.cli.config import ignored_given
    from fedpar.settings import flag_of

    entry, p = dataset_entry(cfg.dataset), cfg.parallel
    text, pipeline, fsdp = entry.train is not None, "--pp 2 or more", "--fsdp 2 or more"
    needs = {"data_path": (text or bool(entry.folder), "--dataset mnist or text"),
             "block_size": (text, "--dataset text"),
             "eval_batches": (text, "--dataset text (the others are scored on their whole test set)"),
             "pp_schedule": (p.pp > 1, pipeline), "microbatches": (p.pp > 1, pipeline),
             "stages_per_rank": (p.pp > 1, pipeline), "cpu_offload": (p.fsdp > 1, fsdp),
             "reshard_after_forward": (p.fsdp > 1, fsdp), "sequence_parallel": (p.tp > 1, "--tp 2 or more"),
             # --lr-scaling none with it: the user turned the scaling off on purpose
             "base_batch_size": (cfg.lr_scaling != "none" or chose(args, "lr_scaling"), "--lr-scaling linear or sqrt"),
             "lr_scaling": (cfg.base_batch_size > 0 or cfg.lr_scaling == "none",
                            "--base-batch-size, the batch size --lr was tuned for"),
             "momentum": (cfg.optimizer == "sgd", "--optimizer sgd")}
    ignored = {dest: f"it needs {need}" for dest, (applies, need) in needs.items() if not applies}
    unused = [f"{_typed(args, dest, flag_of(ParallelConfig if dest in vars(ParallelConfig) else TrainConfig, dest))} "
              f"({ignored[dest]})" for dest in ignored_given(args, ignored)]
    if unused:
        raise ConfigurationError(f"this run would ignore {' and '.join(unused)}: drop "
                                 f"{'it' if len(unused) == 1 else 'them'}, or give what "
                                 f"{'it needs' if len(unused) == 1 else 'they need'}")


def _typed(args: argparse.Namespace, dest: str, flag: str) -> str:
    """``flag`` as the user typed it: a switch turned off is its --no- form."""
    return f"--no-{flag[2:]}" if getattr(args, dest, None) is False else flag


def _spawn_ranks(spawn, world: int, fn, cfg, args: argparse.Namespace) -> None:
    """``spawn`` the ``world`` ranks of ``fn``; a rank's TrainingDiverged (every rank's: the loss is summed over them)
    is raised here as it was, any other failure as RankFailed in one line (--debug: torch's exception, with the
    rank's traceback)."""
    from fedpar.parallel.init import rank_start_method
    from fedpar.parallel.rank_failure import ranks_said_in_one_line
    from fedpar.parallel.trainer import TrainingDiverged

    bar = StepBar()
    try:
        with ranks_said_in_one_line(args.debug, passes=(TrainingDiverged,)):
            spawn(world, fn, cfg, args.dist_timeout, bar, parent_stops=True, start_method=rank_start_method())
    except BaseException:  # stopped or failed: rank 0 may have left its bar up, the cursor hidden
        bar.tidy_after_ranks()
        raise


def _raise_if_reader_left(failure: Exception) -> None:
    """BrokenPipeError (said as Unix tools do: nothing, exit 141) when standard output is a pipe whose reader left:
    rank 0's failure then, though torch may name another rank's that followed it."""
    if reader_left():
        raise BrokenPipeError(str(failure)) from None


def _train_task(args: argparse.Namespace, world: int, held: contextlib.ExitStack | None) -> int:
    """``fedpar train --task``: the task trained centrally (cli/train_task.py), in this process or on ``world``
    engine ranks (DDP, FSDP2, or TP with the task's plan), its model kept as OUT/global.safetensors and global.json
    (``round``: the epochs trained)."""
    from fedpar.cli.train_task import (TaskCheckpoints, check_data_parallel, check_task_degrees, check_task_ranks_fit,
                                       check_zoo_loop_unused)
    from fedpar.parallel.device import check_device_layout

    under_launcher = "WORLD_SIZE" in os.environ
    try:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if under_launcher else world
        given = config_from_args(args)
        task = load_task_from_args(args)  # a task's mistakes, before any rank starts
        check_task_degrees(task, given)  # before the layout: --pp with a task is wrong on any world size
        cfg = given.resolved(world, check_device_layout(args.device, local_ranks))
        check_zoo_loop_unused(args)
        check_data_parallel(task, cfg)
        if not under_launcher:  # ranks torchrun started: no memory check, as for the zoo's models
            check_task_ranks_fit(task, cfg, world)
        latest = TaskCheckpoints(cfg, task).latest()  # one that cannot be resumed: said here, not by every rank
    except (ConfigurationError, ValueError, FileNotFoundError) as exc:  # the task's mistakes too (TaskError)
        print(f"fedpar train: {exc}", file=sys.stderr)
        return 2
    earlier = _earlier_outputs(cfg.out, latest is not None)
    try:
        return _launch_task(args, cfg, task, world, earlier, held)
    finally:
        _settled(earlier)  # also after a failure: a run that wrote nothing loses nothing of the earlier one


def _launch_task(args: argparse.Namespace, cfg: TrainConfig, task, world: int, earlier: EarlierRun | None,
                 held: contextlib.ExitStack | None) -> int:
    """Train ``task`` as ``cfg`` says, here or on ``world`` ranks; the command's exit code."""
    from fedpar.cli.train_task import (PeerLost, TaskCheckpoints, spawn_task_ranks, train_centrally, train_task_rank,
                                       write_task_model)
    from fedpar.parallel.device import resolve_device
    from fedpar.parallel.rank_failure import RankFailed

    under_launcher = "WORLD_SIZE" in os.environ
    try:
        if world > 1:  # the ranks get the layout resolved here, as it is
            rank_args = (cfg, args.task, task_options(args), args.dist_timeout)
            if under_launcher:
                _join_torchrun_group(cfg, args.dist_timeout)
                train_task_rank(*rank_args)
                _leave_finished_rank(earlier, held)
            spawn_task_ranks(world, rank_args, quiet=not args.debug)
            summary = json.loads((Path(cfg.out) / "summary.json").read_text())
            evals = {k: v for k, v in summary.items() if k.startswith(("test_", "val_"))}
        else:
            model, summary = train_centrally(task, cfg, resolve_device(cfg.device))
            evals = write_task_model(task, cfg, model, summary)
    except KeyboardInterrupt as exc:  # SIGINT or SIGTERM (to the launcher: the ranks are stopped): say what is kept
        from fedpar.parallel.stopping import exit_code, signal_name
        if int(os.environ.get("RANK", "0")):
            return exit_code(signal_name(exc))
        print(f"fedpar train: interrupted{TaskCheckpoints(cfg, task).resume_hint()}", file=sys.stderr)
        return exit_code(signal_name(exc))
    except (RankFailed, PeerLost) as exc:  # a rank's own failure, not the task's: its last line (--debug: traceback)
        _raise_if_reader_left(exc)
        print(f"fedpar train: {exc} (--debug shows the traceback)", file=sys.stderr)
        return 1
    except TaskError as exc:  # the task's own code, on any rank: one line (--debug: the traceback)
        if args.debug:
            raise
        _raise_if_reader_left(exc)  # the other rank's training failed as rank 0 left
        print(f"fedpar train: {str(exc).rstrip('.')}: fix the task ({args.task})", file=sys.stderr)
        return getattr(exc, "exit_code", 2)  # TaskFailed: it failed as it trained (1), else it was refused (2)
    print(json.dumps({k: summary[k] for k in ("task", "ranks", "steps", "epochs", *evals)}, indent=2))
    print(f"wrote {cfg.out}/metrics.jsonl, metrics.csv, summary.json, global.safetensors, global.json"
          f"{' and loss_curve.png' if cfg.plot else ''}")
    return 0
