"""Client batching in a simulation worker: the seats of one population host (simulations/population.py) that train
in the same round train as one stacked model (client/batched_trainer.py: the one local loop, run for all of them at
once) instead of one after another. A batching worker has a seat for every member it may train in a round
(:func:`batched_seats`), so a round's members meet in one stack.

The seats stay real agents (each member's download and upload go as its own); only their ``trainer.train`` calls
meet here, and "agent" below means a seat. The rule: the runtime tells how many tasks of a round a pull queued for
its seats before any seat may take one (``trainer.tasks_queued``); an agent takes one as it enters
``trainer.holding_task`` and withdraws when the task ends. A round's batch starts as soon as every agent holding a
task of that round has called ``train`` (or withdrawn) and no task of it waits for a seat that could still take it
(none is queued, or every agent is in a ``train`` call); or else ``gather_seconds`` after the first call, so nobody
waits for an agent that never calls. No window waits for more tasks: a pull's are counted before they are queued. A
call that arrives after its batch started trains in a later batch. Calls with different settings (epochs, batch
size, learning rate, FedProx mu) form separate batches.

Whether a simulation batches at all is :func:`client_batching_route`'s answer to ``--client-batching auto|on|off``.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from fedpar.client.batched_trainer import (ClientBatchInput, ClientBatchOutput, batching_refusal, check_batchable,
                                           member_tensors, train_clients_batched)
from fedpar.client.local_loop import StackRow, TrainResult
from fedpar.client.task_trainer import TaskTrainer, check_training_loss
from fedpar.protocol.task_settings import TaskSettings
from fedpar.task import ClientData, Task, TaskError

log = logging.getLogger("fedpar.simulate")
BATCH_SIZES_KEPT = 1024  # batches whose sizes a batcher remembers
AUTO_MIN_MEMBERS = 2  # a worker's clients of a round that auto batches on a GPU: one alone gains nothing stacked
AUTO_MIN_MEMBERS_CPU = 5  # ... and on the CPU (measured faster at 5 and at 50 when all are sampled: batching_pays)
# What one worker's stack may hold: its members' stacked parameters, their working copy, gradients, optimizer state
# and FedProx anchor (about 8 copies of the model per member).
STACK_BYTES = 2 << 30


def batching_refusal_of(model: nn.Module, task: Task | None, precision: str, member_data: ClientData | None) -> \
        str | None:
    """Why a simulation's members cannot train stacked (one line), or None when they can: ``model`` (the
    federation's), ``task`` (a --task, None for the zoo's models), ``precision`` and one member's ``member_data``."""
    if precision != "fp32":
        return "--client-batching trains in fp32; drop --precision bf16 or --client-batching"
    if task is not None:
        refusal = batching_refusal(task)
        if refusal is not None:
            return refusal
    if member_data is not None and not isinstance(member_data, ClientData):
        return None  # the task's mistake: the workers' check of its client data says it, in one line
    try:
        check_batchable(model)
        if member_data is not None:
            inputs, _ = member_tensors(member_data.train)
            outputs = _first_output(model, inputs[:2])
            if not isinstance(outputs, (torch.Tensor, type(None))):  # a stack's outputs: one tensor, a member axis
                return f"--client-batching stacks the model's output, which must be one tensor; this model returns a " \
                       f"{type(outputs).__name__} (drop --client-batching)"
    except ValueError as exc:
        return str(exc)
    return None


def _first_output(model: nn.Module, inputs: torch.Tensor) -> object:
    """What ``model`` returns for ``inputs`` (None if it raises: its training then says why, as it would)."""
    try:
        with torch.no_grad():
            return model(inputs)
    except Exception:  # the task's code: not for this check to say
        return None


def batched_seats(seats: int, members: int, per_round: int, model_bytes: int) -> int:
    """The seats of a batching worker hosting ``members`` of a federation sampling ``per_round`` a round: enough
    for every member it may train in a round, so that they train as one stack (see :class:`ClientBatcher`), within
    :data:`STACK_BYTES` for a model of ``model_bytes``; never fewer than ``seats`` (--seats)."""
    fit = max(1, STACK_BYTES // max(1, 8 * model_bytes))
    return max(seats, min(members, per_round, fit))


def batching_pays(device: str, model: nn.Module, members_per_worker: float, every_member_sampled: bool) -> bool:
    """Whether stacking a worker's members of a round is expected faster than training them one by one on
    ``device``: on a GPU, where a small member's step is launch-bound, from :data:`AUTO_MIN_MEMBERS` members a
    worker; on the CPU for a model without convolutions, from :data:`AUTO_MIN_MEMBERS_CPU` members a worker when
    every member is sampled each round.

    The CPU rule rests on two measurements, stacked over one by one in the same run (2026-11-25, 2 loaded cores):
    - the training alone in thread CPU time, one torch thread as a worker runs it (benchmarks/stacked_cpu_bench.py,
      results/stacked_cpu_bench.json and 2-3 runs beside it, load 2-7): models without convolutions stack faster
      where auto stacks them (digits MLP 5 members of 130 examples 0.75-0.80, 50 of 13 0.37-0.53; MNIST MLP 5 of
      5,400 0.78-0.95, 50 of 540 0.75-0.87); a convolutional one at no size: the digits CNN (E5 B16) 5 of 13
      1.15-1.39, 5 of 130 0.96-1.07, 50 of 13 1.09-1.38; the MNIST CNN of the FedAvg paper's round (5 of 600 a
      worker, B10) 1.09-1.12, 5 and 50 members of 6 examples 2.5-2.8 and 3.7-3.9 (a stack of its 1.6M-weight
      layer no longer fits the cache). A vmapped convolution does the members' own arithmetic, and on the CPU
      there is no launch cost for stacking to save;
    - whole rounds of `fedpar simulate`, wall-clock pairs alternated (population_bench.py --batching,
      results/client_batching.json, load 9-16): digits MLP 100 of 100 0.68 of 6 pairs, 10 of 10 0.90 over 13, 10 of
      100 (5 sampled members of one step each) 1.02 and 1.18: not faster, hence every member sampled; the digits
      CNN 10 of 10 1.06, 100 of 100 1.70, 10 of 100 1.29 (3 pairs each, load 3-6), the FedAvg paper's round 0.94
      (0.32-1.42) with the whole run's CPU 1.11-1.15 (results/client_batching_cnn.json)."""
    if torch.device(device).type != "cpu":
        return members_per_worker >= AUTO_MIN_MEMBERS
    convolution = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    return not convolution and every_member_sampled and members_per_worker >= AUTO_MIN_MEMBERS_CPU


def client_batching_route(choice: bool | None, refusal: Callable[[], str | None], device: str,
                          members_per_worker: float, model: nn.Module, every_member_sampled: bool) -> bool:
    """Whether a simulation's workers batch their members, for ``--client-batching`` ``choice`` (None: auto, True:
    on, False: off): on batches or raises ValueError(``refusal()``, when it says why not); auto batches when it
    pays (:func:`batching_pays`: ``model`` on ``device``, ``members_per_worker`` of a round, ``every_member_sampled``
    each round; a batching worker seats them all: :func:`batched_seats`) and nothing refuses, else trains one by
    one, saying why at info level."""
    if choice is not None:
        why_not = refusal() if choice else None
        if why_not is not None:
            raise ValueError(why_not)
        return choice
    if not batching_pays(device, model, members_per_worker, every_member_sampled):
        why_not = (f"stacking this model's {members_per_worker:g} members a worker on {device} was not measured "
                   "faster than training them one by one")
    else:
        why_not = refusal()
    log.info("client batching (auto): %s", "on" if why_not is None else f"off, {why_not}")
    return why_not is None


@dataclass
class _Call:
    """One agent's train() call waiting in a batch."""

    client: ClientBatchInput
    output: ClientBatchOutput | None = None
    error: BaseException | None = None


@dataclass
class _Round:
    """One round's tasks in this process."""

    queued: int = 0  # queued by the runtime, not yet taken by a seat
    holding: set[int] = field(default_factory=set)  # agents holding a task of it that have not called train


@dataclass
class _Batch:
    """The calls gathered so far for one round and one set of training settings; the first call's thread decides
    when it starts and runs it, the others wait for ``finished`` (so a call that arrives wakes one thread, not
    every waiting seat)."""

    opened: float
    calls: list[_Call] = field(default_factory=list)
    finished: threading.Event = field(default_factory=threading.Event)


class ClientBatcher:
    """The meeting point of one worker process's agents: their train() calls for a round run as one batch."""

    def __init__(self, device: str = "cpu", compute_lock: threading.Lock | None = None, gather_seconds: float = 1.0):
        self.device, self.gather_seconds = device, gather_seconds
        self._turn = compute_lock if compute_lock is not None else threading.Lock()
        self._cond = threading.Condition()
        self._agents = 0  # BatchedTrainers of this process
        self._training = 0  # agents in a train() call whose batch has not run yet (no seat for a queued task)
        self._rounds: dict[int, _Round] = {}
        self._open: dict[tuple, _Batch] = {}  # batches still gathering, by (round, epochs, batch size, lr, mu)
        self._template: nn.Module | None = None  # one architecture for every batch (its objective is built once)
        self._start: tuple[list[np.ndarray], dict[str, torch.Tensor]] | None = None  # (global weights, as tensors)
        self._task: Task | None = None  # its loss and optimizer (every agent of a process trains one task)
        self._warm = False
        # clients per batch run, in order, the last BATCH_SIZES_KEPT (for tests and diagnostics; a run lasts months)
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=BATCH_SIZES_KEPT)

    def add_agent(self) -> None:
        """Count one more agent training through this batcher."""
        with self._cond:
            self._agents += 1

    def queued(self, round_id: int, count: int) -> None:
        """``count`` tasks of ``round_id`` were queued for this process's agents (negative: dropped unstarted)."""
        with self._cond:
            tasks = self._round(round_id)
            tasks.queued = max(0, tasks.queued + count)
            self._cond.notify_all()

    def _round(self, round_id: int) -> _Round:
        """``round_id``'s tasks (hold the condition's lock); rounds long past are forgotten."""
        tasks = self._rounds.get(round_id)
        if tasks is None:
            tasks = self._rounds[round_id] = _Round()
            for old in [r for r in self._rounds if r < round_id - 2]:
                del self._rounds[old]
        return tasks

    @contextlib.contextmanager
    def holding(self, agent: object, round_id: int):
        """While inside, ``agent`` holds a task of ``round_id`` (one of those queued, if any): that round's batch
        waits for its train() call."""
        with self._cond:
            tasks = self._round(round_id)
            tasks.queued = max(0, tasks.queued - 1)
            tasks.holding.add(id(agent))
        try:
            yield
        finally:
            with self._cond:
                self._not_waiting_for(agent, round_id)

    def start_of(self, arrays: list[np.ndarray], names: list[str]) -> dict[str, torch.Tensor]:
        """The weights ``arrays`` (named ``names``) as the tensors a stack's members start from: made once per global
        model for every seat of the process (a stack copies them into its rows; nothing writes them)."""
        with self._cond:
            if self._start is None or self._start[0] is not arrays:
                self._start = (arrays, {name: torch.tensor(a) for name, a in zip(names, arrays)})
            return self._start[1]

    def warm_up(self, task: Task, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        """One zero-learning-rate batched step, once per process, so torch.func's set-up (it imports
        torch._dynamo) is not billed to a deadline."""
        with self._turn:
            if self._warm:
                return
            self._template, self._task = copy.deepcopy(model), task
            train_clients_batched(self._template, [ClientBatchInput(x[:2], y[:2], seed=0)], 1, 2, 0.0,
                                  device=self.device, loss=task.loss, optimizer=task.optimizer)
            self._warm = True

    def train(self, agent: object, task: Task, model: nn.Module, client: ClientBatchInput, epochs: int,
              batch_size: int, lr: float, round_id: int, proximal_mu: float) -> ClientBatchOutput:
        """Train ``client`` (a member of ``task``) in this round's batch; returns when that batch has run (see the
        module's rule)."""
        settings = (round_id, epochs, batch_size, lr, proximal_mu)
        call = _Call(client)
        with self._cond:
            if self._template is None:
                self._template, self._task = copy.deepcopy(model), task
            batch = self._open.get(settings)
            leads = batch is None
            if leads:
                batch = self._open[settings] = _Batch(time.monotonic())
            batch.calls.append(call)
            self._training += 1
            self._not_waiting_for(agent, round_id)
            while leads and (wait := self._wait(batch, round_id)) > 0:
                self._cond.wait(wait)
            if leads:
                del self._open[settings]  # later calls open a new batch
        if leads:
            self._run(batch, settings)
        else:
            batch.finished.wait()
        if call.error is not None:
            raise call.error
        return call.output

    def _not_waiting_for(self, agent: object, round_id: int) -> None:
        """``agent`` has called train or left its task of ``round_id`` (hold the condition's lock). A waiting batch is
        woken only when this may let it start (:meth:`_wait`: nobody holds a task of its round any more, or every
        seat is in a train call), not at each of a stack's calls, which would wake its leader once per member."""
        tasks = self._rounds.get(round_id)
        if tasks is not None:
            tasks.holding.discard(id(agent))
        if tasks is None or not tasks.holding or self._training >= self._agents:
            self._cond.notify_all()

    def _wait(self, batch: _Batch, round_id: int) -> float:
        """Seconds until ``batch`` may start by the module's rule, if nothing else happens (<= 0: now)."""
        tasks = self._rounds.get(round_id)
        if tasks is None or not tasks.holding and (not tasks.queued or self._training >= self._agents):
            return 0.0  # (None: trained without announcing a task)
        return batch.opened + self.gather_seconds - time.monotonic()

    def _run(self, batch: _Batch, settings: tuple) -> None:
        """Train every call of ``batch`` together (in this process's compute turn) and hand out the results."""
        round_id, epochs, batch_size, lr, mu = settings
        try:
            with self._turn:
                started = time.monotonic()
                outputs = train_clients_batched(self._template, [c.client for c in batch.calls], epochs, batch_size,
                                                lr, round_id, self.device, mu, self._task.loss, self._task.optimizer)
                log.debug("round %d: a stack of %d members trained in %.3f s", round_id, len(batch.calls),
                          time.monotonic() - started)
            for call, output in zip(batch.calls, outputs):
                call.output = output
        except BaseException as exc:  # every agent of the batch sees the failure
            for call in batch.calls:
                call.error = exc
        with self._cond:
            self.batch_sizes.append(len(batch.calls))
            # its seats are free again before any of them wakes: one that takes the round's next task must not
            # count the others, still waking from this batch, as seats in its stack
            self._training -= len(batch.calls)
            self._cond.notify_all()  # a batch waiting on queued tasks may start
        batch.finished.set()


class BatchedTrainer(TaskTrainer):
    """A TaskTrainer whose built-in loop runs stacked with its process's other seats (see :class:`ClientBatcher`);
    evaluation and the weights' exchange are TaskTrainer's, except that the trained weights it hands out are its
    row of the stack (numpy views, not copied back into the model first)."""

    def __init__(self, task: Task, data: ClientData, batcher: ClientBatcher, seed: int = 0,
                 seconds_per_step_delay: float = 0.0, compute_lock: threading.Lock | None = None,
                 device: torch.device | str = "cpu"):
        refusal = batching_refusal(task)
        if refusal is not None:
            raise TaskError(refusal)
        super().__init__(task, data, seed, device, "fp32", seconds_per_step_delay, compute_lock)
        self.batcher = batcher
        batcher.add_agent()
        self.trained: ClientBatchOutput | None = None  # the last run's row of its stack, until new weights come
        # its parameters, listed once (not by a walk of the module tree per member and round): the stacked loop and
        # set_arrays update them in place
        self._params = list(self.model.named_parameters())
        # On the CPU, where every weight is a parameter (so the stack holds them all), the round's global weights are
        # copied into the model only when it is read: the stack starts from them as the batcher keeps them, once for
        # every seat (a copy per member and round cost 35 of a stacked member's 480 us of CPU in a 100-member round)
        self._lazy = self.device.type == "cpu" and [n for n, _ in self._weights.entries] == [n for n, _ in self._params]
        self._global: list[np.ndarray] | None = None  # set, not yet copied into the model

    def warm_up(self) -> None:
        """TaskTrainer's warm-up, and the batcher's (once per process)."""
        super().warm_up()
        self.batcher.warm_up(self.task, self.model, *member_tensors(self.data.train))

    def holding_task(self, round_id: int) -> contextlib.AbstractContextManager:
        """Tell the batcher this agent holds a task of ``round_id`` until the block ends."""
        return self.batcher.holding(self, round_id)

    def tasks_queued(self, round_id: int, count: int) -> None:
        """Tell the batcher that ``count`` tasks of ``round_id`` were queued for its agents."""
        self.batcher.queued(round_id, count)

    def set_arrays(self, arrays: list[np.ndarray]) -> None:
        """Take the round's global weights (the trained row is forgotten): checked now, copied into the model now or,
        where the stack holds every weight, when the model is read (:meth:`_load_trained`)."""
        self.trained = None
        if not self._lazy:
            super().set_arrays(arrays)
            return
        self._weights.check(arrays)
        self._global = arrays

    def get_arrays(self) -> list[np.ndarray]:
        """The trained weights (views of this member's row of the stack, which nothing writes any more), else the
        model's."""
        if self.trained is None or self.device.type != "cpu":
            self._load_trained()
            return super().get_arrays()
        rows = self.trained.weights  # a float buffer is not stacked: the model's own
        return [rows[name].numpy() if name in rows else t.detach().numpy().copy() for name, t in self._weights.entries]

    def evaluate(self):
        """TaskTrainer's evaluation of the model as trained."""
        self._load_trained()
        return super().evaluate()

    def evaluate_splits(self, splits):
        """TaskTrainer's evaluation of the model as trained on each split."""
        self._load_trained()
        return super().evaluate_splits(splits)

    def _load_trained(self) -> None:
        """Copy the last run's row into the model, if it is not there yet, else the global weights set and not yet
        copied."""
        if self.trained is not None:
            with torch.no_grad():
                for name, p in self._params:
                    p.copy_(self.trained.weights[name])
            self.trained, self._global = None, None
        elif self._global is not None:
            arrays, self._global = self._global, None
            super().set_arrays(arrays)

    def train(self, epochs: int, batch_size: int, lr: float, stop_at: float = math.inf,
              proximal_mu: float = 0.0, round_id: int = 0, max_steps: int | None = None,
              settings: TaskSettings | None = None) -> TrainResult:
        """The local loop of this member, run in the batch; a slow device then waits out its simulated delays."""
        if self._global is not None and self.trained is None:
            start = self.batcher.start_of(self._global, [name for name, _ in self._weights.entries])
        else:
            self._load_trained()
            start = {name: p.detach() for name, p in self._params}
        client = ClientBatchInput(*member_tensors(self.data.train), self.seed, start, stop_at, self.delay, max_steps)
        self.trained = self.batcher.train(self, self.task, self.model, client, epochs, batch_size, lr, round_id,
                                          proximal_mu)
        if self.trained.result.examples:  # as the member's own loop says it (NaN: no example trained on)
            check_training_loss(self.task, self.trained.result.loss, lr, self.data.train)
        if self.delay:  # the upload leaves when a slow device's would
            self._sleep(self.trained.result.steps * self.delay)
        return replace(self.trained.result, rows=self._stack_row())

    def _stack_row(self) -> StackRow | None:
        """Where the weights get_arrays hands out are one row of the stack (on the CPU, every array stacked)."""
        stack, names = self.trained.stack, [name for name, _ in self._weights.entries]
        if stack is None or self.device.type != "cpu" or not all(name in stack.params for name in names):
            return None
        return StackRow(stack, tuple(stack.params[name].numpy() for name in names), self.trained.row)
