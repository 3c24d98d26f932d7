"""A task's evaluation: its own hook's named metrics, or the built-in one (mean loss, and accuracy for classifiers).

The coordinator's central evaluation and the agents' federated evaluation both come here.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn

from fedpar.models.evaluation import EvalResult
from fedpar.task import Task, TaskError
from fedpar.tasks.data import batch_examples, default_batches, inputs_and_targets, to_device


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast around forward passes when ``precision`` is bf16, else nothing (a disabled torch.autocast
    still costs about 9 us a step)."""
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


@torch.no_grad()
def builtin_evaluation(task: Task, model: nn.Module, dataset: Any, batch_size: int = 1024,
                       precision: str = "fp32") -> dict[str, float]:
    """The mean of ``task.loss`` over ``dataset``, and ``accuracy`` where the model gives class scores (N, C) for
    integer labels (N,)."""
    device = next(model.parameters()).device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    examples, classified = 0, True
    for batch in default_batches(dataset, batch_size):
        inputs, targets = inputs_and_targets(to_device(batch, device))
        with autocast(device, precision):
            outputs = model(inputs)
        n = batch_examples(targets)
        loss_sum += task.loss(outputs, targets).double() * n
        classified = classified and _class_scores(outputs, targets)
        if classified:
            correct += (outputs.argmax(dim=1) == targets).sum()
        examples += n
    if not examples:
        return {}
    metrics = {"loss": loss_sum.item() / examples}  # one device sync, at the end
    if classified:
        metrics["accuracy"] = correct.item() / examples
    return metrics


def _class_scores(outputs: Any, targets: Any) -> bool:
    """Whether ``outputs`` are per-class scores for the integer labels ``targets``."""
    return (isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor) and outputs.ndim == 2
            and targets.ndim == 1 and not torch.is_floating_point(targets) and len(outputs) == len(targets))


def evaluate_task(task: Task, model: nn.Module, dataset: Any, precision: str = "fp32") -> dict[str, float]:
    """The task's named metrics of ``model`` on ``dataset`` (its evaluate hook, or the built-in evaluation)."""
    model.eval()
    try:
        if task.evaluate is not None:
            with torch.no_grad():
                return named_metrics(task, "evaluate", task.evaluate(model, dataset))
        return builtin_evaluation(task, model, dataset, precision=precision)
    finally:
        model.train()


def task_eval_result(task: Task, model: nn.Module, dataset: Any, precision: str = "fp32") -> EvalResult:
    """The task's metrics of ``model`` on ``dataset`` as an agent reports them (loss and accuracy apart)."""
    metrics = evaluate_task(task, model, dataset, precision)
    loss, accuracy = metrics.pop("loss", None), metrics.pop("accuracy", None)
    return EvalResult(loss, accuracy, len(dataset), metrics)


def named_metrics(task: Task, hook: str, metrics: Any) -> dict[str, float]:
    """``metrics`` as {name: float}; TaskError unless it is a dict of numbers with short word-like names."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise TaskError(f"task {task.name!r}: {hook} must return a dict of named metrics, got "
                        f"{type(metrics).__name__}")
    out = {}
    for name, value in metrics.items():
        if not (isinstance(name, str) and name.isidentifier() and len(name) <= 48):
            raise TaskError(f"task {task.name!r}: {hook} metric name {name!r} must be a word of at most 48 characters "
                            "(letters, digits, _)")
        try:
            out[name] = float(value)
        except (TypeError, ValueError):
            raise TaskError(f"task {task.name!r}: {hook} metric {name!r} must be a number, got {value!r}") from None
    return out


def finite(metrics: dict[str, float]) -> dict[str, float]:
    """The finite entries of ``metrics`` (a NaN loss is not reported: uploads carry finite metrics only)."""
    return {k: v for k, v in metrics.items() if math.isfinite(v)}
