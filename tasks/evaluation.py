"""A task's evaluation: its own hook's named metrics, or the built-in one (mean loss, and accuracy for classifiers).

The coordinator's central evaluation (:class:`TaskEvaluator`) and the agents' federated evaluation (what they
report: :class:`EvalResult`) both come here.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from fedpar.models.weights import set_weights
from fedpar.task import Task, TaskError
from fedpar.tasks.data import batch_examples, default_batches, inputs_and_targets, on_device, to_device


@dataclass
class EvalResult:
    """Loss and accuracy of a model on some examples (None: not measured), and any other named metrics."""

    loss: float | None
    accuracy: float | None  # None: not measured (a Flower client's evaluate without an "accuracy" metric)
    examples: int
    metrics: dict[str, float] = field(default_factory=dict)

    def as_metrics(self) -> dict[str, float]:
        """What an agent reports of it: eval_loss, eval_accuracy, eval_examples and eval_NAME, where finite."""
        named = {"loss": self.loss, "accuracy": self.accuracy, **self.metrics, "examples": float(self.examples)}
        return {f"eval_{k}": float(v) for k, v in named.items() if v is not None and math.isfinite(v)}


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


class TaskEvaluator:
    """Scores weights with the task's evaluation on its test set, both kept on ``device``; metrics are named
    ``test_NAME`` (``test_loss``, ``test_accuracy`` for the built-in classifiers)."""

    def __init__(self, task: Task, test_data: Any, device: torch.device | str = "cpu"):
        """Build the task's model once and keep it and ``test_data`` on ``device``."""
        self.task = task
        self.device = torch.device(device)
        self.model = task.model().to(self.device)
        self.data = on_device(test_data, self.device)

    def __call__(self, weights: Sequence[np.ndarray]) -> dict[str, float]:
        """The named metrics of the model with ``weights``, each as ``test_NAME``."""
        set_weights(self.model, weights)
        return {f"test_{k}": v for k, v in finite(evaluate_task(self.task, self.model, self.data)).items()}
