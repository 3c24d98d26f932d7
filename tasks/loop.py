"""Running a task's training and evaluation: its own hooks, or the built-in loop and evaluation.

The built-in loop takes the task's loss, optimizer and batches, and keeps fedpar's guarantees: it stops before
the deadline (:class:`fedpar.Deadline`), trains the model in place (so its weights keep the layout the coordinator
sent) and counts the examples it trained on. Without a task optimizer it steps plain SGD with torch's own
functional update, as the agents' LocalTrainer does (constructing a torch Optimizer imports torch._dynamo, about a
second of CPU in every process).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fedpar.aggregation.fedprox import proximal_term
from fedpar.client.local_sgd import descend, shuffling_generator, trainable
from fedpar.task import ClientData, Deadline, LocalConfig, Task, TaskError
from fedpar.tasks.data import batch_examples, default_batches, inputs_and_targets, to_device


@dataclass
class Trained:
    """What one local training run did: examples trained on (each time seen), steps, and named metrics."""

    examples: int
    steps: int
    metrics: dict[str, float] = field(default_factory=dict)
    stopped_early: bool = False


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast around forward passes when ``precision`` is bf16, else nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def train_task(task: Task, model: nn.Module, data: ClientData, config: LocalConfig, deadline: Deadline,
               precision: str = "fp32", step_delay: float = 0.0) -> Trained:
    """Train ``model`` in place on ``data`` with the task's own hook or the built-in loop, before ``deadline``."""
    if task.train is None:
        return _builtin_loop(task, model, data, config, deadline, precision, step_delay)
    model.train()
    result = task.train(model, data, config, deadline)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TaskError(f"task {task.name!r}: train must return (examples, metrics), got {type(result).__name__}")
    examples, metrics = result
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 0:
        raise TaskError(f"task {task.name!r}: train must return a whole number of examples >= 0 first, got "
                        f"{examples!r}")
    return Trained(examples, deadline.taken, named_metrics(task, "train", metrics), deadline.stopped_early)


def _builtin_loop(task: Task, model: nn.Module, data: ClientData, config: LocalConfig, deadline: Deadline,
                  precision: str, step_delay: float) -> Trained:
    """Epochs of ``task.loss`` over the task's batches, stepped by its optimizer (or plain SGD), in time."""
    device = torch.device(config.device)
    model.train()
    params = trainable(model)
    optimizer = task.optimizer(params, config.learning_rate) if task.optimizer is not None else None
    anchor = [p.detach().clone() for p in model.parameters()] if config.proximal_mu > 0 else None
    examples, loss_sum = 0, torch.zeros((), dtype=torch.float64, device=device)
    batches = itertools.islice(_epochs(task, data.train, config), config.max_steps)
    for batch in deadline.steps(batches):
        inputs, targets = inputs_and_targets(to_device(batch, device))
        with autocast(device, precision):
            loss = task.loss(model(inputs), targets)
        objective = loss if anchor is None else loss + proximal_term(model.parameters(), anchor, config.proximal_mu)
        if optimizer is None:
            descend(params, objective, config.learning_rate)
        else:
            optimizer.zero_grad(set_to_none=True)
            objective.backward()
            optimizer.step()
        n = batch_examples(targets)
        examples += n
        loss_sum += loss.detach().double() * n
        if step_delay:
            import time
            time.sleep(step_delay)  # a simulated slow device
    metrics = {"loss": float(loss_sum) / examples} if examples else {}
    return Trained(examples, deadline.taken, metrics, deadline.stopped_early)


def _epochs(task: Task, dataset: Any, config: LocalConfig) -> Iterator:
    """The batches of ``config.epochs`` passes over ``dataset``, shuffled in this client's order for the round."""
    loader = task.loader or default_batches
    generator = shuffling_generator(config.seed, config.round)
    for _ in range(config.epochs):
        yield from loader(dataset, config.batch_size, generator)


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
