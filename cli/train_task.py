"""``fedpar train --task``: a task trained centrally, as the baseline of its federated runs.

One process trains the task's model on all of its training data (the client data of ``Partition(0, 1)``) with
the task's own training hook or the built-in loop, one epoch at a time, and evaluates it after each epoch on the
test data (else on the validation data it was given). It writes metrics.jsonl/metrics.csv, summary.json and
loss_curve.png as the parallel trainer does; the caller keeps the trained model (global.safetensors, the layout a
federated run of the same task keeps).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from fedpar.parallel.config import TrainConfig
from fedpar.parallel.metrics import StepMetricsLog, plot_loss_curve, write_json_atomic
from fedpar.task import Deadline, LocalConfig, Partition, Task
from fedpar.tasks.data import on_device
from fedpar.client.task_loop import train_task
from fedpar.tasks.evaluation import evaluate_task, finite


def train_centrally(task: Task, cfg: TrainConfig, device: torch.device) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Train ``task`` for ``cfg.epochs`` (or ``cfg.max_steps`` steps) at ``cfg.lr`` in batches of ``cfg.batch_size``;
    returns the trained model and the summary written to ``cfg.out``/summary.json."""
    started = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    model = task.model().to(device)
    data = task.client_data(Partition(0, 1, "central", "iid", cfg.seed, 0.0))
    data.train, data.val = on_device(data.train, device), on_device(data.val, device) if data.val else None
    test = task.test_data() if task.test_data is not None else None
    scored, prefix = (on_device(test, device), "test_") if test is not None else (data.val, "val_")
    log = StepMetricsLog(out, True, 0, cfg.tensorboard)
    steps = examples = epoch = 0
    evals: dict[str, float] = {}
    train_metrics: dict[str, float] = {}
    train_seconds = 0.0
    while epoch < cfg.epochs if not cfg.max_steps else steps < cfg.max_steps:
        begin = time.perf_counter()
        remaining = cfg.max_steps - steps if cfg.max_steps else None
        trained = train_task(task, model, data, LocalConfig(1, cfg.batch_size, cfg.lr, epoch, cfg.seed, 0.0,
                                                              remaining, device), Deadline(device=device))
        train_seconds += time.perf_counter() - begin
        steps, examples, epoch = steps + trained.steps, examples + trained.examples, epoch + 1
        train_metrics = finite(trained.metrics)
        log.write({"kind": "train", "step": steps, "epoch": epoch - 1, **train_metrics,
                   "samples_per_second": trained.examples / max(time.perf_counter() - begin, 1e-9)})
        if scored is not None:
            evals = {prefix + k: v for k, v in finite(evaluate_task(task, model, scored)).items()}
            log.write({"kind": "eval", "step": steps, "epoch": epoch - 1, **evals})
        print(f"epoch {epoch - 1}: step {steps}, " + ", ".join(f"{k} {v:.4f}" for k, v in
                                                               {**train_metrics, **evals}.items()), flush=True)
        if not trained.steps:
            break  # nothing left to train on (a train hook that took no steps ends the run too)
    log.close()
    summary = {"task": task.name, "model": task.description, "device": str(device), "steps": steps,
               "examples": examples, "epochs": epoch, **evals,
               **{f"final_train_{k}": v for k, v in train_metrics.items()},
               "wall_seconds": time.perf_counter() - started, "train_seconds": train_seconds,
               "config": cfg.to_dict()}
    write_json_atomic(out / "summary.json", summary)
    if cfg.plot:
        plot_loss_curve(log.records(), out / "loss_curve.png", f"{task.name}, centralized")
    return model, summary
