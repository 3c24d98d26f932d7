"""``fedpar train --task``: a task trained centrally, as the baseline of its federated runs.

One process trains the task's model on all of its training data (the client data of ``Partition(0, 1)``) with
the task's own training hook or the built-in loop, one epoch at a time, and evaluates it after each epoch on the
test data (else on the validation data it was given). It writes metrics.jsonl/metrics.csv, summary.json and
loss_curve.png as the parallel trainer does; the caller keeps the trained model (global.safetensors, the layout a
federated run of the same task keeps).

With ``--nproc N`` (or under torchrun) the ranks train one model on the parallel engine as a large-model agent
does (client/engine_trainer.py): DDP (``--dp-replicate``, the default), FSDP2 (``--fsdp``) or the task's
tensor-parallel plan (``--tp``), the task's loss and optimizer over each global batch of ``--batch-size`` dealt to
the data-parallel ranks by the engine's sampler, so a step sees the global batch. Rank 0 drives one epoch at a time,
gathers the whole model, evaluates it, logs and writes.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import TracebackType
from typing import Any, Callable

import torch

from fedpar.cli.progress import StepBar, time_left
from fedpar.cli.user_errors import UserError
from fedpar.client.task_trainer import Trained, train_task
from fedpar.parallel.config import TrainConfig
from fedpar.parallel.device import queue_waiter
from fedpar.parallel.epoch_checkpoint import (EpochCheckpointError, check_epoch_checkpoint, latest_epoch_checkpoint,
                                              load_epoch_checkpoint, save_epoch_checkpoint)
from fedpar.parallel.init import DistInfo
from fedpar.parallel.metrics import StepMetricsLog, plot_loss_curve, write_json_atomic
from fedpar.task import (TASK_CODE_ERRORS, ClientData, Deadline, LocalConfig, Partition, Task, TaskError, TaskFailed,
                         check_test_data, check_training_data, checked_client_data, raised)
from fedpar.tasks.data import on_device
from fedpar.tasks.reference import from_anywhere
from fedpar.tasks.evaluation import evaluate_task, finite

# TrainConfig's choices of the zoo's model and data, which a task replaces: a task run's summary leaves them out
ZOO_CHOICES = ("dataset", "model", "data_path", "model_kwargs", "block_size")

EpochRun = Callable[[int, "int | None"], Trained]  # (epoch, steps left or None) -> what that epoch trained
# A rank whose collective failed because another rank went away waits this long before it fails in turn, so that the
# launcher hears the other rank's failure (the cause) first: on the 16-core GPU box the follower's gloo error won
# that race and was said as the task's failure.
PEER_LOST_GRACE_SECONDS = 5.0


class task_code:
    """Around a call into the task's own code as it trains (``stage``: which of it): whatever it raises becomes one
    TaskFailed line, 'the task's STAGE raised TYPE: MESSAGE', chained to the original (--debug shows its
    traceback); a TaskError (e.g. what a train hook returned) is said as it is."""

    def __init__(self, stage: str):
        self.stage = stage

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        if not isinstance(exc, TASK_CODE_ERRORS) or isinstance(exc, TaskFailed):
            return False
        if peer_lost(exc):  # not the task's doing: the launcher stops this rank meanwhile
            time.sleep(PEER_LOST_GRACE_SECONDS)
            raise PeerLost(f"another rank went away as this one trained ({raised(exc)})") from exc
        if isinstance(exc, TaskError):
            raise TaskFailed(str(exc)) from exc
        raise TaskFailed(f"the task's {self.stage} raised {raised(exc)}") from exc


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective's failure because another rank went away (gloo's or NCCL's), not the task's."""
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, dist.DistError) or "gloo/transport" in text or "Connection closed by peer" in text


def _client_data(task: Task, seed: int) -> ClientData:
    """All of the task's training data (the client data of ``Partition(0, 1)``); TaskError unless it can train."""

    try:
        data = checked_client_data(task.client_data(Partition(0, 1, "central", "iid", seed, 0.0)))
    except TaskError:
        raise
    except Exception as exc:  # the task's own code
        raise TaskError(f"the task's client_data raised {raised(exc)}") from exc
    check_training_data(task.name, data)
    return data


def _diagnosed(task: Task, failure: TaskFailed) -> TaskError:
    """``failure`` of the engine's set-up, or what is wrong with the task's model when that is why (Task.built_model
    on the meta device: nothing allocated; only after a failure, so a factory that cannot build there is never
    refused)."""
    try:
        with torch.device("meta"):
            task.built_model()
    except TaskError as problem:
        return problem
    except Exception:
        pass
    return failure


def train_centrally(task: Task, cfg: TrainConfig, device: torch.device,
                    info: DistInfo | None = None) -> tuple[torch.nn.Module | None, dict[str, Any]]:
    """Train ``task`` for ``cfg.epochs`` (or ``cfg.max_steps`` steps) at ``cfg.lr`` in batches of ``cfg.batch_size``
    (on the engine when ``info`` places this process in a joined group of several ranks); returns the trained model
    and the summary written to ``cfg.out``/summary.json on rank 0, (None, {}) on the others."""
    started = time.perf_counter()
    torch.manual_seed(cfg.seed)
    data = _client_data(task, cfg.seed)
    world = info.world_size if info is not None else 1
    if world > 1:
        from fedpar.client.engine_trainer import EngineTrainer

        try:
            with task_code("model() or its first training step"):  # the engine builds, shards and warms it up
                engine = EngineTrainer(task, data, info, cfg.parallel, seed=cfg.seed)
        except TaskFailed as failure:
            raise _diagnosed(task, failure) from failure.__cause__
        if not info.is_main:
            with task_code("training"):
                engine.follow()
            return None, {}
        model, run = engine.model, _engine_epochs(engine, cfg)
    else:
        engine, model = None, task.built_model().to(device)
        data.train, data.val = on_device(data.train, device), on_device(data.val, device) if data.val else None
        run = _local_epochs(task, model, data, cfg, device)
    try:
        summary = _epochs(task, cfg, model, run, data.val, started)
    finally:
        if engine is not None:
            engine.shutdown()
    summary = {**summary, "device": str(device), "ranks": world}
    write_json_atomic(Path(cfg.out) / "summary.json", summary)
    return model, summary


def _local_epochs(task: Task, model: torch.nn.Module, data, cfg: TrainConfig, device: torch.device) -> EpochRun:
    """One process: each epoch is one run of the task's hook or built-in loop."""
    def run(epoch: int, remaining: int | None) -> Trained:
        return train_task(task, model, data, LocalConfig(1, cfg.batch_size, cfg.lr, epoch, cfg.seed, 0.0, remaining,
                                                         device), Deadline(wait=queue_waiter(device)))
    return run


def _engine_epochs(engine, cfg: TrainConfig) -> EpochRun:
    """Rank 0 of the engine: each epoch is one training command to every rank, its result gathered back."""
    def run(epoch: int, remaining: int | None) -> Trained:
        result = engine.train(1, cfg.batch_size, cfg.lr, round_id=epoch, max_steps=remaining)
        return Trained(result.examples, result.steps, finite({"loss": result.loss}), result.stopped_early)
    return run


def _epochs(task: Task, cfg: TrainConfig, model: torch.nn.Module, run: EpochRun, val: Any,
            started: float) -> dict[str, Any]:
    """Rank 0: train epoch after epoch, evaluating after each, logging as the parallel trainer does; the summary."""
    bar = StepBar("step" if cfg.max_steps else "epoch")
    try:
        return _epochs_shown(bar, task, cfg, model, run, val, started)
    finally:
        bar.close()  # a stop or an error too: the bar down and the cursor shown before the line said of it


def _epochs_shown(bar: StepBar, task: Task, cfg: TrainConfig, model: torch.nn.Module, run: EpochRun, val: Any,
                  started: float) -> dict[str, Any]:
    """:func:`_epochs`, its progress on ``bar``."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    eval_device = next(model.parameters()).device
    with task_code("test_data()"):
        test = task.test_data() if task.test_data is not None else None
    check_test_data(task.name, test)
    scored, prefix = (on_device(test, eval_device), "test_") if test is not None else (val, "val_")
    checkpoints = TaskCheckpoints(cfg, task)
    counters = checkpoints.resume(model, bar)
    steps, examples, epoch = int(counters["steps"]), int(counters["examples"]), int(counters["epoch"])
    train_seconds = counters["train_seconds"]
    log = StepMetricsLog(out, True, steps, cfg.tensorboard)
    evals: dict[str, float] = {}
    train_metrics: dict[str, float] = {}
    first_epoch, first_steps = epoch, steps  # where this process began: its pace gives the time left
    if epoch and (steps >= cfg.max_steps if cfg.max_steps else epoch >= cfg.epochs):  # a finished run resumed
        end = f"step {cfg.max_steps}" if cfg.max_steps else f"epoch {cfg.epochs - 1}"
        bar.line(f"the checkpoint is after epoch {epoch - 1} (step {steps}), already at or after the run's last "
                 f"{end}: nothing to train (raise {'--max-steps' if cfg.max_steps else '--epochs'} to train on, or "
                 "pass --no-resume to start afresh)")
        train_metrics, evals = _last_logged(log.records(), steps, prefix)
    while epoch < cfg.epochs if not cfg.max_steps else steps < cfg.max_steps:
        begin = time.perf_counter()
        with task_code("training"):
            trained = run(epoch, cfg.max_steps - steps if cfg.max_steps else None)
        train_seconds += time.perf_counter() - begin
        steps, examples, epoch = steps + trained.steps, examples + trained.examples, epoch + 1
        train_metrics = finite(trained.metrics)
        log.write({"kind": "train", "step": steps, "epoch": epoch - 1, **train_metrics,
                   "samples_per_second": trained.examples / max(time.perf_counter() - begin, 1e-9)})
        if scored is not None:
            with task_code("evaluation"):
                evals = {prefix + k: v for k, v in finite(evaluate_task(task, model, scored)).items()}
            log.write({"kind": "eval", "step": steps, "epoch": epoch - 1, **evals})
        left = time_left(epoch - first_epoch, cfg.epochs - first_epoch, time.perf_counter() - started) \
            if not cfg.max_steps else time_left(steps - first_steps, cfg.max_steps - first_steps,
                                                time.perf_counter() - started)
        bar.line(f"epoch {epoch - 1}: step {steps}, " + ", ".join(f"{k} {v:.4f}" for k, v in
                                                                  {**train_metrics, **evals}.items())
                 + f", {left} left")
        bar.step(*((steps, cfg.max_steps) if cfg.max_steps else (epoch, cfg.epochs)),
                 ", ".join(f"{k} {v:.4f}" for k, v in list({**train_metrics, **evals}.items())[:2]))
        checkpoints.after_epoch(model, {"epoch": epoch, "steps": steps, "examples": examples,
                                        "train_seconds": train_seconds})
        if not trained.steps:
            break  # nothing left to train on (a train hook that took no steps ends the run too)
    bar.close()
    log.close()
    if cfg.plot:
        plot_loss_curve(log.records(), out / "loss_curve.png", f"{task.name}, centralized")
    return {"task": task.name, "model": task.description, "steps": steps, "examples": examples, "epochs": epoch,
            "resumed_from_epoch": int(counters["epoch"]),
            **evals, **{f"final_train_{k}": v for k, v in train_metrics.items()},
            "wall_seconds": time.perf_counter() - started, "train_seconds": train_seconds,
            "config": {k: v for k, v in cfg.to_dict().items() if k not in ZOO_CHOICES}}


def _last_logged(records: list[dict[str, Any]], steps: int, prefix: str) -> tuple[dict[str, float], dict[str, float]]:
    """The train and evaluation figures a resumed run logged last, up to ``steps``: a finished run resumed trains
    and evaluates nothing, and its summary keeps them."""
    train: dict[str, float] = {}
    evals: dict[str, float] = {}
    for record in records:
        if record.get("step", 0) > steps:
            continue
        figures = {k: v for k, v in record.items() if k not in ("kind", "step", "epoch", "samples_per_second")}
        if record.get("kind") == "train":
            train = figures
        elif record.get("kind") == "eval":
            evals = {k: v for k, v in figures.items() if k.startswith(prefix)}
    return train, evals


class TaskCheckpoints:
    """``fedpar train --task``'s checkpoints in OUT/checkpoints (parallel/epoch_checkpoint.py): after an epoch once
    --checkpoint-every steps passed since the last one (0: none), and the run resumed from the latest (--resume)."""

    def __init__(self, cfg: TrainConfig, task: Task):
        self.directory = Path(cfg.out) / "checkpoints"
        self.every, self.resumes = cfg.checkpoint_every, cfg.resume
        self.record = {"--task": from_anywhere(task.name), "model": task.description}
        self.afresh = f"pass --no-resume to start afresh in {cfg.out} (or another --out)"
        self.last_steps = 0

    def latest(self) -> Path | None:
        """The checkpoint a resume starts from (None: none, or --no-resume); EpochCheckpointError for one that cannot
        be resumed."""
        if not self.resumes:
            return None
        latest = latest_epoch_checkpoint(self.directory, self.afresh)
        if latest is not None:
            check_epoch_checkpoint(latest, self.record, self.afresh)
        return latest

    def resume(self, model: torch.nn.Module, bar: StepBar) -> dict[str, float]:
        """Load the latest checkpoint into ``model``; the counters to go on from (all 0 when starting afresh)."""
        latest = self.latest()
        if latest is None:
            return dict.fromkeys(("epoch", "steps", "examples", "train_seconds"), 0.0)
        try:
            counters = load_epoch_checkpoint(latest, model, self.afresh)
        except EpochCheckpointError as exc:  # the task's model changed since (its file edited): one line, exit 2
            raise UserError(str(exc)) from None
        self.last_steps = int(counters["steps"])
        bar.line(f"resumed from {latest} after epoch {int(counters['epoch']) - 1} (step {self.last_steps})")
        return counters

    def resume_hint(self) -> str:
        """What an interrupted run can do next: resume after its latest checkpoint, or keep one next time."""
        try:
            latest = latest_epoch_checkpoint(self.directory, self.afresh)
        except ValueError:  # a damaged pointer is said when the run is resumed
            latest = None
        if latest is None and self.every:  # asked for, but stopped before the first one was kept
            return (f"; nothing to resume from yet (--checkpoint-every {self.every} keeps the first at the end of the "
                    f"first epoch after {self.every} steps)")
        if latest is None:
            return ("; nothing to resume from (--checkpoint-every K keeps a checkpoint at the end of an epoch after "
                    "each K steps)")
        again = "the same command" if self.resumes else "the same command without --no-resume"
        return f"; {again} resumes after its checkpoint {latest.name}"

    def after_epoch(self, model: torch.nn.Module, counters: dict[str, float]) -> None:
        """Keep a checkpoint of the epoch just trained if --checkpoint-every steps passed since the last one."""
        if self.every and counters["steps"] - self.last_steps >= self.every:
            save_epoch_checkpoint(self.directory, model, counters, self.record)
            self.last_steps = int(counters["steps"])


# TrainConfig's settings of the zoo trainer's own loop (parallel/trainer.py), which a task's loop, optimizer and
# per-epoch evaluation replace: given beside --task, each would be ignored
ZOO_LOOP = ("block_size", "optimizer", "optimizer_impl", "momentum", "weight_decay", "grad_accum", "grad_clip",
            "warmup_steps", "lr_scaling", "base_batch_size", "activation_checkpointing", "compile", "eval_batches",
            "log_every", "pp_schedule", "microbatches", "stages_per_rank")


def check_zoo_loop_unused(args) -> None:
    """TaskError naming the zoo trainer's options the user typed beside --task, whose own loop, optimizer and
    evaluation would ignore them (a --config file's are said in a note: cli/config.py ignored_given)."""
    from fedpar.cli.config import ignored_given
    from fedpar.parallel.config import ParallelConfig
    from fedpar.settings import flag_of

    given = [flag_of(ParallelConfig if hasattr(ParallelConfig, k) else TrainConfig, k)
             for k in ignored_given(args, dict.fromkeys(ZOO_LOOP, "--task trains with its own loop"))]
    if given:
        raise TaskError(f"--task trains with the task's own loop, optimizer and evaluation, one epoch at a time, so "
                        f"{' and '.join(given)} would be ignored: drop {'it' if len(given) == 1 else 'them'} (it "
                        "takes --epochs or --max-steps, --lr, --batch-size, --seed, --checkpoint-every, --resume and "
                        "the parallel degrees)")


def check_task_degrees(task: Task, cfg: TrainConfig) -> None:
    """TaskError for degrees of ``cfg`` as given (not yet resolved) that ``task`` cannot take on any world size."""
    from fedpar.client.engine_trainer import check_engine_task

    check_engine_task(task, cfg.parallel, 1)  # world 1: what depends on the world waits for check_data_parallel


def check_data_parallel(task: Task, cfg: TrainConfig) -> None:
    """TaskError (or ConfigurationError) for a task or settings that the engine ranks of ``cfg``'s resolved layout
    (TrainConfig.resolved) cannot train."""
    from fedpar.client.engine_trainer import check_engine_task

    check_engine_task(task, cfg.parallel, cfg.parallel.world_size)  # the batch's split: checked as it was resolved


def check_task_ranks_fit(task: Task, cfg: TrainConfig, ranks: int) -> None:
    """ValueError, one line, when the ``ranks`` processes started here (1: this one) cannot hold their shards of
    ``task``'s model with its gradients and optimizer state (parallel/preflight.py, as for the zoo's models). The
    model is built on the meta device (nothing allocated); one whose factory cannot build there is not checked, and
    the task's data is not counted (each rank loads it with the task's own code)."""
    from fedpar.parallel.preflight import check_train_ranks_fit

    try:
        with torch.device("meta"):
            parameters = sum(p.numel() for p in task.built_model().parameters())
    except Exception:  # said as the task builds it for real, if it is wrong there too
        return
    check_train_ranks_fit(cfg, ranks, parameters, model="model (the task's model())")


def train_task_rank(config: TrainConfig, task_ref: str, task_options: dict[str, Any], timeout_seconds: float) -> None:
    """One rank of ``fedpar train --task --nproc N`` (spawned, or launched by torchrun): join the group, train the
    task on the engine (``config``: as the launcher resolved it, its layout used as is), and on rank 0 write the
    outputs and the model."""
    from fedpar.parallel.init import init_distributed, shutdown_distributed
    from fedpar.tasks.reference import load_task

    info = init_distributed(timeout_seconds, config.device)
    try:
        task = load_task(task_ref, task_options)
        model, summary = train_centrally(task, config, info.device, info)
        if info.is_main:
            write_task_model(task, config, model, summary)
        torch.distributed.barrier()  # leave together: rank 0 hosts the rendezvous store
    finally:
        shutdown_distributed()


class PeerLost(Exception):
    """Another rank went away as this one trained (a collective failed): not the task's doing."""


def spawn_task_ranks(world: int, rank_args: tuple, quiet: bool = True) -> None:
    """:func:`train_task_rank` on ``world`` spawned ranks. A rank's TaskError (or TaskFailed) is raised here as it
    was (its one line), any other failure as RankFailed; unless ``quiet`` is False (--debug): then torch's own
    exception, with the rank's traceback, and torch's note that it stops the others."""
    from fedpar.parallel.init import rank_start_method, spawn
    from fedpar.parallel.rank_failure import ranks_said_in_one_line

    try:
        with ranks_said_in_one_line(not quiet, passes=(TaskFailed, TaskError)):
            spawn(world, train_task_rank, *rank_args, parent_stops=True, start_method=rank_start_method())
    except BaseException:  # stopped or failed: rank 0 may have left its bar up, the cursor hidden
        StepBar().tidy_after_ranks()
        raise


def write_task_model(task: Task, cfg: TrainConfig, model: torch.nn.Module, summary: dict[str, Any]) -> dict:
    """OUT/global.safetensors and global.json of the trained model (``round``: the epochs trained), in the layout
    a federated run of the task keeps; returns the evaluation metrics of the summary."""
    from fedpar.models.weights import get_weights, weight_specs
    from fedpar.protocol.model_file import write_final_model

    evals = {k: v for k, v in summary.items() if k.startswith(("test_", "val_"))}
    write_final_model(Path(cfg.out), [name for name, _, _ in weight_specs(model)], get_weights(model),
                      max(summary["epochs"], 1), task.description, {"round": summary["epochs"], **evals})
    return evals
