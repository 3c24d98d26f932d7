"""An agent's trainer for any :class:`fedpar.Task`: the task's model and local data on one device, trained by its
own hook or the built-in loop, and evaluated with its named metrics.

The built-in loop is the one local loop (client/local_loop.py) on one model: the task's loss, optimizer and
batches, with fedpar's guarantees: it stops before the deadline (:class:`fedpar.Deadline`), trains the model in
place (so its weights keep the layout the coordinator sent) and counts the examples it trained on. Without a task
optimizer it steps plain SGD with torch's own functional update (constructing a torch Optimizer imports
torch._dynamo, about a second of CPU in every process).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import numbers
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from fedpar.client.local_loop import (Lane, OneMember, TrainResult, kept_draws, member_batches, member_draws,
                                      objective, run_loop, trainable, update)
from fedpar.client.trainer_protocol import CalledOff, Spec
from fedpar.datasets.arrays import scale_hint
from fedpar.models.weights import ModelWeights, weight_specs
from fedpar.parallel.config import PRECISIONS
from fedpar.parallel.device import queue_waiter
from fedpar.protocol.task_settings import TaskSettings
from fedpar.task import (ClientData, Deadline, LocalConfig, StepClock, Task, TaskError, check_training_data,
                         checked_client_data, checked_task, first_difference, is_task_failure, raised)
from fedpar.tasks.data import batch_examples, default_batches, inputs_and_targets, on_device, to_device
from fedpar.tasks.evaluation import (EvalResult, autocast, finite, named_metrics, task_eval_result,
                                     task_eval_results)

log = logging.getLogger("fedpar.client")
LATE_SECONDS = 0.5  # a train hook returning this long after its deadline is warned about


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
    with member_draws(config.seed, config.round, torch.device(config.device)):
        if task.train is None:
            return _builtin_loop(task, model, data, config, deadline, precision, after_step)
        model.train()
        layout = weight_specs(model)
        result = task.train(model, data, config, deadline)
    _check_layout_kept(task, model, layout)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TaskError(f"task {task.name!r}: train must return (examples, metrics), got {type(result).__name__}")
    examples, metrics = result
    if isinstance(examples, bool) or not isinstance(examples, numbers.Integral) or examples < 0:  # numpy's too
        raise TaskError(f"task {task.name!r}: train must return a whole number of examples >= 0 first (an int: "
                        f".item() of a tensor), got {examples!r}")
    examples = int(examples)
    if examples == 0 and not deadline.stopped_early and deadline.remaining() > 0:  # not a member out of time
        raise TaskError(f"task {task.name!r}: train returned 0 examples, though its deadline did not stop it: return "
                        "how many examples it trained on, each once per pass (they weigh its update)")
    if examples > len(data.train) * config.epochs:  # the coordinator would refuse the update's weight
        raise TaskError(f"task {task.name!r}: train returned {examples} examples, more than its {len(data.train)} "
                        f"training examples x {config.epochs} epochs: count each example once per pass")
    return Trained(examples, deadline.taken, named_metrics(task, "train", metrics), deadline.stopped_early)


def _check_layout_kept(task: Task, model: nn.Module, layout: list) -> None:
    """TaskError when the task's train hook left ``model`` with other weights than ``layout``, those it was given (a
    layer replaced, a dtype changed): the coordinator could not take them, nor model() load them."""
    now = weight_specs(model)
    if now != layout:
        where = first_difference(now, layout, "model() made")
        raise TaskError(f"task {task.name!r}: train changed the model's weights ({where}); train the model it is given "
                        "in place (no layer replaced, added or removed, no .half() or .double()): its weights are what "
                        "the coordinator averages")


def _builtin_loop(task: Task, model: nn.Module, data: ClientData, config: LocalConfig, deadline: Deadline,
                  precision: str, after_step: Callable[[], None] | None) -> Trained:
    """The one local loop (client/local_loop.py) on ``model``: epochs of ``task.loss`` over the task's batches,
    stepped by its optimizer (or plain SGD), in time."""
    device = torch.device(config.device)
    on_cpu = device.type == "cpu"
    if not model.training:  # fedpar switches modes on the root only; a walk of the module tree costs ~25 us
        model.train()
    params = trainable(model)
    optimizer = task.optimizer(params, config.learning_rate) if task.optimizer is not None else None
    check_steps_the_model(task, optimizer, params)
    anchor = [p.detach().clone() for p in model.parameters()] if config.proximal_mu > 0 else None

    def step(batch) -> tuple[int, float | torch.Tensor]:
        inputs, targets = inputs_and_targets(to_device(batch, device))
        with autocast(device, precision):
            loss = task.batch_loss(model(inputs), targets)
        update(params, objective(loss, model.parameters(), anchor, config.proximal_mu), config.learning_rate,
               optimizer)
        n = batch_examples(targets)
        # the same float64 product either way; on the CPU read at once (nothing to wait for), saving three torch calls
        return n, loss.item() * n if on_cpu else loss.detach().double() * n

    batches = itertools.islice(member_batches(data.train, config.batch_size, config.epochs, config.seed,
                                              config.round, task.loader), config.max_steps)
    (tally,) = run_loop(OneMember(batches, step), [Lane(deadline.at)], deadline.clock, deadline.wait,
                        after_step=after_step)
    deadline.taken, deadline.stopped_early = tally.steps, tally.stopped
    metrics = {"loss": float(tally.loss_sum) / tally.examples} if tally.examples else {}
    check_training_loss(task, metrics.get("loss", 0.0), config.learning_rate, data.train)
    return Trained(tally.examples, tally.steps, metrics, tally.stopped)


def check_steps_the_model(task: Task, optimizer: Any, params: list) -> None:
    """TaskError when the task's ``optimizer`` holds none of ``params``, those it was made with (it was made of a
    model of its own): the model would never move, each round 'ok'."""
    groups = getattr(optimizer, "param_groups", None)
    if not params or not isinstance(groups, list):  # no optimizer, or one of the task's own kind: not read
        return
    held = {id(p) for group in groups if isinstance(group, dict) for p in group.get("params", ())}
    if not any(id(p) in held for p in params):
        raise TaskError(f"task {task.name!r}: optimizer(parameters, lr) holds none of the parameters it is given (a "
                        "model of its own?): make it of them, e.g. torch.optim.Adam(parameters, lr)")


def check_training_loss(task: Task, loss: float, lr: float, train: object = None) -> None:
    """TaskError, in one line, when a member's mean training loss is NaN or infinite: its weights are lost too, so
    it is said now, not later as NaN weights (with features far out of scale in ``train``, said as the likely cause)."""
    if not math.isfinite(loss):
        hint = scale_hint(train)
        raise TaskError(f"task {task.name!r}: the training loss is {loss} (lr {lr:g}): training diverged, {hint}"
                        if hint else f"task {task.name!r}: the training loss is {loss} (lr {lr:g}): training "
                        "diverged (lower --lr), or loss(outputs, targets) is not finite")


class TaskTrainer:
    """A :class:`~fedpar.client.trainer_protocol.Trainer`: a task's model and one client's data on ``device``,
    trained by the task's own hook or the built-in loop, and evaluated with its named metrics. The model is built
    once (or given, ``model``), so its weights keep the layout the coordinator expects.

    Simulations add two things: agents sharing one process share its interpreter lock, and stepping dozens of
    small models at once only adds lock hand-offs and cache misses (several times slower per step), so such hosts
    pass one ``compute_lock`` and each agent trains in one turn (a simulated slow device,
    ``seconds_per_step_delay``, gives the turn up while it sleeps); and a host's seat takes on one client after
    another (:meth:`use_data`).
    """

    framework = "torch"
    reads_task_settings = False
    evaluates_together = True
    survives_failed_training = True

    def __init__(self, task: Task, data: ClientData, seed: int = 0, device: torch.device | str = "cpu",
                 precision: str = "fp32", seconds_per_step_delay: float = 0.0,
                 compute_lock: threading.Lock | None = None, model: torch.nn.Module | None = None):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.task = checked_task(task, "TaskTrainer")
        checked_client_data(data, "TaskTrainer's data must be")
        self.device = torch.device(device)
        self._wait = queue_waiter(self.device)  # what each run's Deadline calls before a clock read: per device
        self.precision = precision
        model = task.built_model() if model is None else model
        if not isinstance(model, torch.nn.Module):
            raise TaskError(f"task {task.name!r}: model() must return a torch.nn.Module, got {type(model).__name__}")
        self.model = model.to(self.device)
        self._layout = weight_specs(self.model)  # what the coordinator sends and takes back
        # The built-in loop updates the tensors in place, so they are listed once; a train hook may replace them, so
        # they are listed again after each of its runs (not at every get and set: a state_dict walk each)
        self._weights = ModelWeights(self.model)
        self._turn = compute_lock
        self._said_late = False  # a train hook that overruns its deadline is said once
        self._called_off = threading.Event()  # the runtime is stopping: a slow device's pause ends at once
        self.use_data(data, seed, seconds_per_step_delay)

    def use_data(self, data: ClientData, seed: int, seconds_per_step_delay: float = 0.0) -> None:
        """Train from now on as another client: its data (kept on the device), its shuffling seed, its device speed
        (a simulation host's seat takes on each sampled virtual client in turn)."""
        check_training_data(self.task.name, data)
        self.data = ClientData(on_device(data.train, self.device),
                               on_device(data.val, self.device) if data.val is not None and len(data.val) else None)
        self.seed = seed
        self.delay = seconds_per_step_delay  # simulated slow hardware (simulations only)
        self._clock = StepClock()  # a step's time, kept between runs for the next run's first deadline test

    def array_specs(self) -> list[Spec]:
        """(name, dtype, shape) of the model's weights, as :func:`fedpar.models.weights.weight_specs`."""
        return weight_specs(self.model)

    def get_arrays(self) -> list[np.ndarray]:
        """The model's weights (what the agent uploads), as :func:`fedpar.models.weights.get_weights`."""
        return self._weights.get()

    def set_arrays(self, arrays: list[np.ndarray]) -> None:
        """Load the round's global weights into the model, as :func:`fedpar.models.weights.set_weights`."""
        self._weights.set(arrays)

    @property
    def num_examples(self) -> int:
        """Size of the local training set."""
        return len(self.data.train)

    def holding_task(self, round_id: int) -> contextlib.AbstractContextManager:
        """The span in which the agent holds a task of ``round_id`` (nothing to do here; a trainer that batches
        several agents' training uses it to know whom to wait for)."""
        return contextlib.nullcontext()

    def tasks_queued(self, round_id: int, count: int) -> None:
        """Nothing: each seat trains on its own."""

    def warm_up(self) -> None:
        """One forward and backward pass (and a zero-step SGD update) on a small batch of the built-in loop's, so
        torch's lazy set-up is not billed to a deadline; the weights do not change."""
        if self.task.train is not None or self.task.loss is None:
            return
        self.model.train()
        loader = self.task.loader or default_batches
        with self._task_code("training"):
            batch = next(iter(loader(self.data.train, 2, torch.Generator().manual_seed(0))), None)
        if batch is None:
            return
        inputs, targets = inputs_and_targets(to_device(batch, self.device))
        params = trainable(self.model)
        with autocast(self.device, self.precision), self._task_code("training"):
            loss = self.task.batch_loss(self.model(inputs), targets)
        if self.task.optimizer is None:
            update(params, loss, lr=0.0)  # the weights do not change
        else:
            loss.backward()
        for p in params:
            p.grad = None

    def train(self, epochs: int, batch_size: int, lr: float, stop_at: float = math.inf, proximal_mu: float = 0.0,
              round_id: int = 0, max_steps: int | None = None, settings: TaskSettings | None = None) -> TrainResult:
        """Train for ``epochs`` (at most ``max_steps`` steps) or until ``time.monotonic()`` would pass ``stop_at``
        (``settings``: not read)."""
        start = time.monotonic()
        config = LocalConfig(epochs, batch_size, lr, round_id, self.seed, proximal_mu, max_steps, self.device)
        deadline = Deadline(stop_at, self._wait, self._clock)
        try:
            with self._taking_turn(), self._task_code("training"):
                trained = train_task(self.task, self.model, self.data, config, deadline, self.precision,
                                     self._pause if self.delay else None)
        except Exception:
            self._keep_layout()
            raise
        finally:
            if self.task.train is not None:
                self._weights = ModelWeights(self.model)
        late = time.monotonic() - stop_at
        if late > LATE_SECONDS and self.task.train is not None and not self._said_late:
            self._said_late = True  # the hook's habit, not one member's: said once
            log.warning("task %r: train returned %.1f s after its deadline, so its update may come too late; loop "
                        "over deadline.steps(batches) to stop in time", self.task.name, late)
        elif late > LATE_SECONDS:
            # fedpar's own loop stops at a step's end: one step took longer than timed (a simulated slow device's)
            log.info("task %r: a step ended %.1f s after the deadline", self.task.name, late)
        metrics = dict(trained.metrics)
        loss = metrics.pop("loss", math.nan)
        return TrainResult(trained.steps, trained.examples, loss, trained.stopped_early, time.monotonic() - start,
                           finite(metrics))

    def evaluate(self) -> EvalResult | None:
        """The task's metrics on the local validation split (None when there is none)."""
        if self.data.val is None:
            return None
        with self._taking_turn(), self._task_code("evaluation"):
            return task_eval_result(self.task, self.model, self.data.val, self.precision)

    def evaluate_splits(self, splits: Sequence[Any]) -> list[EvalResult | None]:
        """The task's metrics on each of ``splits`` (members' validation splits), the built-in evaluation of them
        all in one pass where it can (tasks/evaluation.py task_eval_results)."""
        splits = [None if split is None else on_device(split, self.device) for split in splits]  # as use_data keeps
        with self._taking_turn(), self._task_code("evaluation"):
            return task_eval_results(self.task, self.model, splits, self.precision)

    @contextlib.contextmanager
    def _taking_turn(self):
        """Hold this process's compute turn (if agents share one) for the duration."""
        if self._turn is None:
            yield
            return
        with self._turn:
            yield

    def _keep_layout(self) -> None:
        """A fresh model() in place of one a failed train hook left with other weights (a layer replaced, a dtype
        changed), so that the next round's weights load into it."""
        if self.task.train is not None and weight_specs(self.model) != self._layout:
            self.model = self.task.built_model().to(self.device)

    @contextlib.contextmanager
    def _task_code(self, stage: str):
        """Run the task's code of ``stage``: a SystemExit or KeyboardInterrupt it raises itself (fedpar.task
        is_task_failure: not a Ctrl-C) is a TaskError, the member's failure, not the end of a seat's thread (whose
        members' rounds would then wait out their deadlines)."""
        try:
            yield
        except (SystemExit, KeyboardInterrupt) as exc:
            if not is_task_failure(exc):
                raise
            raise TaskError(f"task {self.task.name!r}: its {stage} raised {raised(exc)}, which would end the whole "
                            "process: raise an exception instead") from exc

    def call_off(self) -> None:
        """End training now (the runtime is stopping): a slow device's pause wakes and its task ends in CalledOff."""
        self._called_off.set()

    def _pause(self) -> None:
        """Sleep one step's delay like a slow device would, without holding the compute turn."""
        if self._turn is None:
            self._sleep(self.delay)
            return
        # the seat that trains meanwhile draws from its own member's stream (client/local_loop.member_draws)
        with kept_draws(self.device):
            self._turn.release()
            try:
                self._sleep(self.delay)
            finally:
                self._turn.acquire()

    def _sleep(self, seconds: float) -> None:
        """Wait ``seconds`` as a slow device would; CalledOff as soon as :meth:`call_off` is called (a trace's step
        may last a day, which a stopping run must not wait for)."""
        if self._called_off.wait(seconds):
            raise CalledOff("the runtime is stopping")
