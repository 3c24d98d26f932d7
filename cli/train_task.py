"""``fedpar train --task``: a task trained centrally, as the baseline of its federated runs.

One process trains the task's model on all of its training data (the client data of ``Partition(0, 1)``) with
the task's own training hook or the built-in loop, one epoch at a time, and evaluates it after each epoch on the
test data (else on the validation data it was given). It writes metrics.jsonl/metrics.csv, summary.json and
loss_curve.png as the parallel trainer does; the caller keeps the trained model (global.safetensors, the layout a
federated run of the same task keeps).

With ``--nproc N`` (or under torchrun) the ranks train one model with DistributedDataParallel: each rank runs the
task's built-in loop (its loss, optimizer and loader) on its share of the training data at ``--batch-size / N``
per step, and DDP averages the gradients, so a step sees the global batch. The shares are cut as the engine's
sampler cuts (parallel/sampler.py): one seeded permutation, wrapped around to a multiple of N, dealt round-robin,
so every rank takes the same number of steps. Rank 0 evaluates, logs and writes.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from fedpar.parallel.config import TrainConfig
from fedpar.parallel.metrics import StepMetricsLog, plot_loss_curve, write_json_atomic
from fedpar.task import ClientData, Deadline, LocalConfig, Partition, Task, TaskError
from fedpar.tasks.data import on_device, subset
from fedpar.client.task_loop import Trained, train_task
from fedpar.tasks.evaluation import evaluate_task, finite


def train_centrally(task: Task, cfg: TrainConfig, device: torch.device, rank: int = 0,
                    world: int = 1) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Train ``task`` for ``cfg.epochs`` (or ``cfg.max_steps`` steps) at ``cfg.lr`` in batches of ``cfg.batch_size``
    (this process is ``rank`` of ``world`` DDP ranks, in a joined process group when ``world`` > 1); returns the
    trained model and the summary written to ``cfg.out``/summary.json."""
    started = time.perf_counter()
    main = rank == 0
    out = Path(cfg.out)
    if main:
        out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    model = task.model().to(device)
    data = task.client_data(Partition(0, 1, "central", "iid", cfg.seed, 0.0))
    batch_size, trained_model = cfg.batch_size, model
    if world > 1:
        batch_size, trained_model = _data_parallel(task, cfg, model, device, world)
        data = ClientData(rank_share(data.train, rank, world, cfg.seed), data.val)
    data.train, data.val = on_device(data.train, device), on_device(data.val, device) if data.val else None
    test = task.test_data() if task.test_data is not None and main else None
    scored, prefix = (on_device(test, device), "test_") if test is not None else (data.val if main else None, "val_")
    log = StepMetricsLog(out, main, 0, cfg.tensorboard)
    steps = examples = epoch = 0
    evals: dict[str, float] = {}
    train_metrics: dict[str, float] = {}
    train_seconds = 0.0
    while epoch < cfg.epochs if not cfg.max_steps else steps < cfg.max_steps:
        begin = time.perf_counter()
        remaining = cfg.max_steps - steps if cfg.max_steps else None
        trained = train_task(task, trained_model, data, LocalConfig(1, batch_size, cfg.lr, epoch, cfg.seed, 0.0,
                                                                      remaining, device), Deadline(device=device))
        if world > 1:
            trained = _summed_over_ranks(trained, device)
        train_seconds += time.perf_counter() - begin
        steps, examples, epoch = steps + trained.steps, examples + trained.examples, epoch + 1
        train_metrics = finite(trained.metrics)
        log.write({"kind": "train", "step": steps, "epoch": epoch - 1, **train_metrics,
                   "samples_per_second": trained.examples / max(time.perf_counter() - begin, 1e-9)})
        if scored is not None:
            evals = {prefix + k: v for k, v in finite(evaluate_task(task, model, scored)).items()}
            log.write({"kind": "eval", "step": steps, "epoch": epoch - 1, **evals})
        if main:
            print(f"epoch {epoch - 1}: step {steps}, " + ", ".join(f"{k} {v:.4f}" for k, v in
                                                                   {**train_metrics, **evals}.items()), flush=True)
        if not trained.steps:
            break  # nothing left to train on (a train hook that took no steps ends the run too)
    log.close()
    summary = {"task": task.name, "model": task.description, "device": str(device), "ranks": world,
               "steps": steps, "examples": examples, "epochs": epoch, **evals,
               **{f"final_train_{k}": v for k, v in train_metrics.items()},
               "wall_seconds": time.perf_counter() - started, "train_seconds": train_seconds,
               "config": cfg.to_dict()}
    if not main:
        return model, summary
    write_json_atomic(out / "summary.json", summary)
    if cfg.plot:
        plot_loss_curve(log.records(), out / "loss_curve.png", f"{task.name}, centralized")
    return model, summary


def rank_share(dataset: Any, rank: int, world: int, seed: int) -> Any:
    """Rank ``rank``'s share of ``dataset``: one permutation drawn from ``seed``, wrapped around to a multiple of
    ``world`` examples and dealt round-robin (as parallel/sampler.py deals batches), so every share is as long."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
    total = math.ceil(len(dataset) / world) * world
    order = order.repeat(math.ceil(total / len(order)))[:total]
    return subset(dataset, order[rank::world].numpy())


def _data_parallel(task: Task, cfg: TrainConfig, model: torch.nn.Module, device: torch.device,
                   world: int) -> tuple[int, torch.nn.Module]:
    """Each rank's batch size and ``model`` wrapped in DDP over the whole group (TaskError for what cannot)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fedpar.parallel.ddp import apply_ddp

    check_data_parallel(task, cfg, world)
    return cfg.batch_size // world, apply_ddp(model, init_device_mesh(device.type, (world,)))


def check_data_parallel(task: Task, cfg: TrainConfig, world: int) -> None:
    """TaskError for a task or settings that ``world`` DDP ranks cannot train."""
    if world > 1 and task.train is not None:
        raise TaskError(f"task {task.name!r} has its own train hook, which trains in one process; drop --nproc "
                        "(and torchrun)")
    layout = {f"--{name}": getattr(cfg.parallel, name) for name in ("fsdp", "tp", "pp")}
    if any(degree > 1 for degree in layout.values()):
        raise TaskError(f"a task trains with DDP only for now; drop {', '.join(k for k, v in layout.items() if v > 1)}")
    if world > 1 and cfg.batch_size % world:
        raise TaskError(f"--batch-size {cfg.batch_size} (global) must be divisible by the {world} ranks")


def _summed_over_ranks(trained: Trained, device: torch.device) -> Trained:
    """One epoch's counts over every rank, and its mean loss over all their examples (every rank gets them)."""
    import torch.distributed as dist

    loss = trained.metrics.get("loss", 0.0)
    totals = torch.tensor([trained.examples, loss * trained.examples], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    examples = int(totals[0].item())
    metrics = {"loss": totals[1].item() / examples} if examples else {}
    return Trained(examples, trained.steps, metrics, trained.stopped_early)


def train_task_rank(cfg: dict[str, Any], task_ref: str, task_options: dict[str, Any], timeout_seconds: float) -> None:
    """One rank of ``fedpar train --task --nproc N`` (spawned, or launched by torchrun): join the group, train the
    task with DDP, and on rank 0 write the outputs and the model."""
    from fedpar.parallel.config import train_config_from_dict
    from fedpar.parallel.init import init_distributed, shutdown_distributed
    from fedpar.tasks.reference import load_task

    config = train_config_from_dict(cfg)
    info = init_distributed(timeout_seconds, config.device)
    try:
        task = load_task(task_ref, task_options)
        model, summary = train_centrally(task, config, info.device, info.rank, info.world_size)
        if info.is_main:
            write_task_model(task, config, model, summary)
        torch.distributed.barrier()  # leave together: rank 0 hosts the rendezvous store
    finally:
        shutdown_distributed()


def write_task_model(task: Task, cfg: TrainConfig, model: torch.nn.Module, summary: dict[str, Any]) -> dict:
    """OUT/global.safetensors and global.json of the trained model (``round``: the epochs trained), in the layout
    a federated run of the task keeps; returns the evaluation metrics of the summary."""
    from fedpar.models.weights import get_weights, weight_specs
    from fedpar.server.final_model import write_final_model

    evals = {k: v for k, v in summary.items() if k.startswith(("test_", "val_"))}
    write_final_model(Path(cfg.out), [name for name, _, _ in weight_specs(model)], get_weights(model),
                      max(summary["epochs"], 1), task.description, {"round": summary["epochs"], **evals})
    return evals
