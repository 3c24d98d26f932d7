"""A task's local training: its own train hook, or the built-in loop.

The built-in loop is the one local loop (client/local_loop.py) on one model: the task's loss, optimizer and
batches, with fedpar's guarantees: it stops before the deadline (:class:`fedpar.Deadline`), trains the model in
place (so its weights keep the layout the coordinator sent) and counts the examples it trained on. Without a task
optimizer it steps plain SGD with torch's own functional update (constructing a torch Optimizer imports
torch._dynamo, about a second of CPU in every process).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fedpar.client.local_loop import Lane, OneMember, member_batches, objective, run_loop, update
from fedpar.client.local_sgd import trainable
from fedpar.task import ClientData, Deadline, LocalConfig, Task, TaskError
from fedpar.tasks.data import batch_examples, inputs_and_targets, to_device
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
    """The one local loop (client/local_loop.py) on ``model``: epochs of ``task.loss`` over the task's batches,
    stepped by its optimizer (or plain SGD), in time."""
    device = torch.device(config.device)
    if not model.training:  # fedpar switches modes on the root only; a walk of the module tree costs ~25 us
        model.train()
    params = trainable(model)
    optimizer = task.optimizer(params, config.learning_rate) if task.optimizer is not None else None
    anchor = [p.detach().clone() for p in model.parameters()] if config.proximal_mu > 0 else None

    def step(batch) -> tuple[int, torch.Tensor]:
        inputs, targets = inputs_and_targets(to_device(batch, device))
        with autocast(device, precision):
            loss = task.loss(model(inputs), targets)
        update(params, objective(loss, model.parameters(), anchor, config.proximal_mu), config.learning_rate,
               optimizer)
        n = batch_examples(targets)
        return n, loss.detach().double() * n

    batches = itertools.islice(member_batches(data.train, config.batch_size, config.epochs, config.seed,
                                              config.round, task.loader), config.max_steps)
    (tally,) = run_loop(OneMember(batches, step), [Lane(deadline.at)], deadline.clock, deadline.wait,
                        after_step=after_step)
    deadline.taken, deadline.stopped_early = tally.steps, tally.stopped
    metrics = {"loss": float(tally.loss_sum) / tally.examples} if tally.examples else {}
    return Trained(tally.examples, tally.steps, metrics, tally.stopped)
