"""A task's evaluation: its own hook's named metrics, or the built-in one (mean loss, and accuracy for classifiers).

The coordinator's central evaluation (:class:`TaskEvaluator`) and the agents' federated evaluation (what they
report: :class:`EvalResult`) both come here.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from fedpar.models.weights import ModelWeights, set_weights
from fedpar.protocol.codec import MAX_CLIENT_METRICS, MAX_METRIC_MAGNITUDE
from fedpar.task import Task, TaskError, TaskFailed, check_dataset, is_task_failure, raised
from fedpar.tasks.data import (batch_examples, default_batches, in_memory, inputs_and_targets, on_device, subset,
                               to_device)

log = logging.getLogger("fedpar.tasks")


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
    """The mean of ``task.loss`` over ``dataset`` in batches of the task's ``loader`` (default: in order), and
    ``accuracy`` where the model gives class scores (N, C) for integer labels (N,)."""
    check_dataset(f"task {task.name!r}: the dataset to evaluate (test_data())", dataset)
    device = next(model.parameters()).device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    examples, classified = 0, True
    # batched as the built-in loop batches: the task's loader may be what makes its examples (inputs, targets)
    batches = task.loader(dataset, batch_size, torch.Generator().manual_seed(0)) if task.loader is not None else \
        default_batches(dataset, batch_size)
    for batch in batches:
        inputs, targets = inputs_and_targets(to_device(batch, device))
        with autocast(device, precision):
            outputs = model(inputs)
        n = batch_examples(targets)
        loss_sum += task.batch_loss(outputs, targets).double() * n
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


@torch.no_grad()
def builtin_evaluation_of_splits(task: Task, model: nn.Module, splits: Sequence[Any], batch_size: int = 1024,
                                 precision: str = "fp32") -> list[dict[str, float]] | None:
    """:func:`builtin_evaluation` of each of ``splits`` (e.g. several members' validation splits) with one forward
    pass per batch over their examples together; None unless all are in-memory (inputs, targets) tensors of one
    kind, the task has no loader of its own and the model's outputs are one tensor of a row per example (then
    evaluate them one by one)."""
    tensors = [in_memory(split) for split in splits]
    if task.loader is not None or not tensors or any(t is None or len(t) != 2 for t in tensors) or any(
            (t[0].shape[1:], t[0].dtype, t[1].shape[1:], t[1].dtype)
            != (tensors[0][0].shape[1:], tensors[0][0].dtype, tensors[0][1].shape[1:], tensors[0][1].dtype)
            for t in tensors):
        return None
    device = next(model.parameters()).device
    inputs = torch.cat([t[0] for t in tensors]).to(device)
    targets = torch.cat([t[1] for t in tensors]).to(device)
    sizes = [len(t[0]) for t in tensors]
    bounds = np.cumsum([0] + sizes).tolist()
    owner = torch.from_numpy(np.repeat(np.arange(len(splits)), sizes)).to(device)  # each example's split
    # each split's share of each batch: its mean loss and its examples, summed per split at the end in this order
    losses, counts, owners = [], [], []
    correct = torch.zeros(len(splits), dtype=torch.int64, device=device)
    classified = [True] * len(splits)
    for begin in range(0, len(inputs), batch_size):
        end = min(begin + batch_size, len(inputs))
        with autocast(device, precision):
            outputs = model(inputs[begin:end])
        if not (isinstance(outputs, torch.Tensor) and outputs.ndim and len(outputs) == end - begin):
            return None  # a dict or tuple of outputs, say: not cut per split here, so each is evaluated alone
        scores = _class_scores(outputs, targets[begin:end])
        if scores:  # every split's hits in this batch at once
            correct.index_add_(0, owner[begin:end], (outputs.argmax(dim=1) == targets[begin:end]).long())
        for k in range(len(splits)):  # each split's share of this batch, as builtin_evaluation sums it
            lo, hi = max(bounds[k], begin), min(bounds[k + 1], end)
            if lo >= hi:
                continue
            out, tgt = outputs[lo - begin:hi - begin], targets[lo:hi]
            losses.append(task.batch_loss(out, tgt))
            counts.append(hi - lo)
            owners.append(k)
            classified[k] = classified[k] and (scores or _class_scores(out, tgt))
            if classified[k] and not scores:
                correct[k] += (out.argmax(dim=1) == tgt).sum()
    # one device sync, at the end; each share's loss times its examples in float64, as builtin_evaluation sums it
    shares = [loss * n for loss, n in zip(torch.stack(losses).tolist() if losses else [], counts)]
    loss_sums = [0.0] * len(splits)
    for k, share in zip(owners, shares):
        loss_sums[k] += share
    hits = correct.tolist()
    results = []
    for k in range(len(splits)):
        examples = bounds[k + 1] - bounds[k]
        metrics = {"loss": loss_sums[k] / examples} if examples else {}
        if examples and classified[k]:
            metrics["accuracy"] = hits[k] / examples
        results.append(metrics)
    return results


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


def task_eval_results(task: Task, model: nn.Module, splits: Sequence[Any],
                      precision: str = "fp32") -> list[EvalResult | None]:
    """:func:`task_eval_result` of ``model`` on each of ``splits`` (None for an empty or missing one): the built-in
    evaluation of them all in one pass where it can (:func:`builtin_evaluation_of_splits`), else one by one."""
    present = [k for k, split in enumerate(splits) if split is not None and len(split)]
    results: list[EvalResult | None] = [None] * len(splits)
    together = None
    if task.evaluate is None and present:
        model.eval()
        try:
            together = builtin_evaluation_of_splits(task, model, [splits[k] for k in present], precision=precision)
        finally:
            model.train()
    for n, k in enumerate(present):
        if together is None:
            results[k] = task_eval_result(task, model, splits[k], precision)
            continue
        metrics = together[n]
        loss, accuracy = metrics.pop("loss", None), metrics.pop("accuracy", None)
        results[k] = EvalResult(loss, accuracy, len(splits[k]), metrics)
    return results


def named_metrics(task: Task, hook: str, metrics: Any) -> dict[str, float]:
    """``metrics`` as {name: float}; TaskError unless it is a dict of numbers with short word-like names."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise TaskError(f"task {task.name!r}: {hook} must return a dict of named metrics, got "
                        f"{type(metrics).__name__}")
    if len(metrics) > MAX_HOOK_METRICS:
        raise TaskError(f"task {task.name!r}: {hook} returned {len(metrics)} metrics, more than the {MAX_HOOK_METRICS} "
                        "an update carries: return fewer")
    out = {}
    for name, value in metrics.items():
        if not (isinstance(name, str) and name.isidentifier() and len(name) <= 48):
            raise TaskError(f"task {task.name!r}: {hook} metric name {name!r} must be a word of at most 48 characters "
                            "(letters, digits, _)")
        try:
            out[name] = float(value)
        except (TypeError, ValueError):
            raise TaskError(f"task {task.name!r}: {hook} metric {name!r} must be a number, got {value!r}") from None
        if abs(out[name]) > MAX_METRIC_MAGNITUDE:  # NaN passes here: left out below
            raise TaskError(f"task {task.name!r}: {hook} metric {name!r} = {value!r} is beyond the "
                            f"+-{MAX_METRIC_MAGNITUDE:g} an update carries")
        if not math.isfinite(out[name]) and (hook, name) not in _SAID_NOT_FINITE:
            _SAID_NOT_FINITE.add((hook, name))  # said once per process: every member's evaluation may give it
            log.warning("task %r: %s gave %s = %s, which is left out of the metrics (they hold finite numbers only); "
                        "leave a metric out where it cannot be measured", task.name, hook, name, out[name])
    return out


_SAID_NOT_FINITE: set[tuple[str, str]] = set()
# An update carries at most MAX_CLIENT_METRICS: the train hook's and the evaluation's share them, beside the 5
# fedpar adds (train_loss, train_seconds, eval_loss, eval_accuracy, eval_examples).
MAX_HOOK_METRICS = (MAX_CLIENT_METRICS - 5) // 2


def finite(metrics: dict[str, float]) -> dict[str, float]:
    """The finite entries of ``metrics`` (a NaN loss is not reported: uploads carry finite metrics only)."""
    return {k: v for k, v in metrics.items() if math.isfinite(v)}


CHECK_EXAMPLES = 64  # of the test set, that the built-in evaluation is tried on as a task loads


class TaskEvaluator:
    """Scores weights with the task's evaluation on its test set, both kept on ``device``; metrics are named
    ``test_NAME`` (``test_loss``, ``test_accuracy`` for the built-in classifiers)."""

    def __init__(self, task: Task, test_data: Any, device: torch.device | str = "cpu"):
        """Build the task's model once and keep it and ``test_data`` on ``device``."""
        self.task = task
        self.device = torch.device(device)
        self.model = task.built_model().to(self.device)
        self.data = on_device(test_data, self.device)
        # The built-in evaluation leaves the model's tensors in place, so they are listed once (a state_dict walk per
        # round took 5% of the coordinator loop's time in a small model's round); an evaluate hook may replace them.
        self._weights = ModelWeights(self.model) if task.evaluate is None else None

    def check(self) -> None:
        """TaskError, one line, unless the task's evaluation runs on the model as ``model()`` made it: said as the
        task loads, not after a first round (the built-in evaluation is tried on one batch's worth of examples)."""
        data = self.data
        if self.task.evaluate is None and hasattr(data, "__len__") and len(data) > CHECK_EXAMPLES:
            data = subset(data, np.arange(CHECK_EXAMPLES))
        try:
            evaluate_task(self.task, self.model, data)
        except TaskError:
            raise
        except BaseException as exc:  # the task's own code (a Ctrl-C, is_task_failure tells, stops the run)
            if not is_task_failure(exc):
                raise
            raise TaskError(self._failure(exc)) from exc

    def __call__(self, weights: Sequence[np.ndarray]) -> dict[str, float]:
        """The named metrics of the model with ``weights``, each as ``test_NAME``; TaskFailed when the task's
        evaluation raises."""
        if self._weights is not None:
            self._weights.set(weights)
        else:
            set_weights(self.model, weights)
        try:
            metrics = evaluate_task(self.task, self.model, self.data)
        except TaskError as exc:
            raise TaskFailed(str(exc)) from exc
        except BaseException as exc:  # the task's own code: the run stops with one line (a Ctrl-C: as it stops)
            if not is_task_failure(exc):
                raise
            raise TaskFailed(self._failure(exc)) from exc
        return {f"test_{k}": v for k, v in finite(metrics).items()}

    def _failure(self, exc: Exception) -> str:
        return f"the task's evaluation raised {raised(exc)}: fix the task ({self.task.name})"
