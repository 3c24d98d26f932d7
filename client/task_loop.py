"""A task's local training: its own train hook, or the built-in loop.

The built-in loop takes the task's loss, optimizer and batches, and keeps fedpar's guarantees: it stops before
the deadline (:class:`fedpar.Deadline`), trains the model in place (so its weights keep the layout the coordinator
sent) and counts the examples it trained on. Without a task optimizer it steps plain SGD with torch's own
functional update, as the agents' LocalTrainer does (constructing a torch Optimizer imports torch._dynamo, about a
second of CPU in every process).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fedpar.aggregation.fedprox import proximal_term
from fedpar.client.local_sgd import descend, shuffling_generator, trainable
from fedpar.task import ClientData, Deadline, LocalConfig, Task, TaskError
from fedpar.tasks.data import batch_examples, default_batches, inputs_and_targets, to_device
from fedpar.tasks.evaluation import autocast, named_metrics


@dataclass
class Trained:
    """What one local training run did: examples trained on (each time seen), steps, and named metrics."""

    examples: int
    steps: int
    metrics: dict[str, float] = field(default_factory=dict)
    stopped_early: bool = False


def train_task(task: Task, model: nn.Module, data: ClientData, config: LocalConfig, deadline: Deadline,
               precision: str = "fp32", after_step: Callable[[], None] | None = None) -> Trained:
    """Train ``model`` in place on ``data`` with the task's own hook or the built-in loop, before ``deadline``
    (``after_step``: called after each step of the built-in loop; a simulated slow device waits there)."""
    if task.train is None:
        return _builtin_loop(task, model, data, config, deadline, precision, after_step)
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
                  precision: str, after_step: Callable[[], None] | None) -> Trained:
    """Epochs of ``task.loss`` over the task's batches, stepped by its optimizer (or plain SGD), in time."""
    device = torch.device(config.device)
    if not model.training:  # fedpar switches modes on the root only; a walk of the module tree costs ~25 us
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
        if after_step is not None:
            after_step()
    metrics = {"loss": float(loss_sum) / examples} if examples else {}
    return Trained(examples, deadline.taken, metrics, deadline.stopped_early)


def _epochs(task: Task, dataset: Any, config: LocalConfig) -> Iterator:
    """The batches of ``config.epochs`` passes over ``dataset``, shuffled in this client's order for the round."""
    loader = task.loader or default_batches
    generator = shuffling_generator(config.seed, config.round)
    for _ in range(config.epochs):
        yield from loader(dataset, config.batch_size, generator)
