"""Local training for agents that are a process group of their own, on the shared parallel engine (FSDP/DDP/TP).

The agent trains a :class:`fedpar.Task`: its model, its loss and optimizer (else plain SGD), and its client data,
dealt to the data-parallel ranks batch by batch by the engine's sampler. Rank 0 is the one the
:class:`~fedpar.client.agent.Agent` drives: it holds a plain, whole copy of the task's model (``model``: what the
agent downloads into, evaluates with the task's evaluation and uploads from, so the coordinator sees the names and
shapes a single-process agent of the task has). ``train`` broadcasts that copy to the sharded model on every rank,
trains all ranks on their shares of each batch, and gathers the result back into it. The other ranks sit in
:meth:`EngineTrainer.follow` until rank 0 says shutdown. ``fedpar train --task`` on several ranks drives it the same
way, one epoch per call.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fedpar.client.engine_control import SHUTDOWN, TRAIN, Command, ControlChannel
from fedpar.client.local_loop import (Lane, OneMember, StepTally, TrainResult, member_orders, run_loop, trainable,
                                     update)
from fedpar.client.trainer_protocol import Spec
from fedpar.client.task_trainer import check_steps_the_model
from fedpar.models.weights import get_weights, set_weights, weight_specs
from fedpar.parallel.checkpoint import gather_full_state_dict, load_full_state_dict_from_rank0
from fedpar.parallel.config import ParallelConfig, layout_for
from fedpar.parallel.init import DistInfo
from fedpar.parallel.mesh import build_mesh
from fedpar.parallel.parallelize import parallelize
from fedpar.parallel.sampler import DistributedBatchSampler
from fedpar.protocol.task_settings import TaskSettings
from fedpar.task import ClientData, StepClock, Task, TaskError, check_training_data
from fedpar.tasks.data import batch_at, batch_examples, inputs_and_targets, on_device, to_device
from fedpar.tasks.evaluation import EvalResult, task_eval_result, task_eval_results

ShardBatch = tuple[int, tuple[list[int], torch.Tensor]]  # batch number in its epoch, (this rank's indices, not-padding)


def check_engine_task(task: Task, config: ParallelConfig, world_size: int) -> None:
    """TaskError, in one line, for a task the engine cannot train on ``world_size`` ranks laid out as ``config``."""
    if world_size > 1 and task.train is not None:
        raise TaskError(f"task {task.name!r} has its own train hook, which trains in one process; drop --nproc and "
                        "the engine options (--fsdp, --dp-replicate, --tp; and torchrun)")
    if config.pp > 1:
        raise TaskError(f"task {task.name!r} declares no pipeline stages, so --pp does not apply to it; spread "
                        "the model with --fsdp (or --tp with a tp_plan) instead")
    if config.tp > 1 and task.tp_plan is None:
        raise TaskError(f"task {task.name!r} declares no tensor-parallel plan (Task.tp_plan), so --tp does not "
                        "apply to it; drop --tp, or give the task a tp_plan")


class EngineTrainer:
    """A :class:`~fedpar.client.trainer_protocol.Trainer` over a sharded model (rank 0's whole copy is what the
    runtime exchanges).

    Construct on every rank of the group at once (it is collective); then rank 0 hands itself to an Agent
    and calls :meth:`shutdown` when the agent is done, while every other rank calls :meth:`follow`.
    """

    framework = "torch"
    reads_task_settings = False
    evaluates_together = True
    survives_failed_training = False  # the other ranks raised too, or wait in a collective rank 0 left

    def __init__(self, task: Task, data: ClientData, info: DistInfo, parallel: ParallelConfig, seed: int = 0,
                 shuffle: bool = True, idle_timeout_seconds: float = 7 * 86400.0, warm_up: bool = True,
                 data_seed: int | None = None):
        """Shard ``task.model()`` over the group as ``parallel`` says (pp must be 1: a ParallelLayout its launcher
        resolved, or settings resolved here) and, unless ``warm_up`` is False, warm everything up; rank 0's whole
        copy starts from the weights ``seed`` draws. The data's order is a single process's of seed ``data_seed``
        (``seed`` unless given; an agent's: client/local_loop.py member_seed) in every round, cut over the ranks."""
        config = layout_for(parallel, info.world_size, info.device.type)
        check_engine_task(task, config, info.world_size)
        check_training_data(task.name, data)
        self.task, self.info, self.seed, self.shuffle = task, info, seed, shuffle
        self.data_seed = seed if data_seed is None else data_seed
        self.mesh = build_mesh(config, info.device.type)
        self._dp_size, self._dp_rank = config.data_parallel_size, self.mesh.data_parallel_rank
        self._counts = self.mesh.coord("tp") == 0  # TP peers see the same examples: count them once
        self.module = parallelize(task.model, "task", config, self.mesh, info, task.loss, seed,
                                  tp_plan=task.tp_plan).parts[0]
        self._host = self._whole_model(task, seed) if info.is_main else None
        self._control = ControlChannel(info.device, idle_timeout_seconds)
        self.train_data = on_device(data.train, info.device)
        self.val = data.val if data.val is not None and len(data.val) and info.is_main else None
        self._clock = StepClock()
        self._gather_seconds = 0.0
        if warm_up:
            self._warm_up_all_ranks()

    @staticmethod
    def _whole_model(task: Task, seed: int) -> nn.Module:
        torch.manual_seed(seed)  # the weights every rank's shards were cut from (parallelize draws the same)
        model = task.model()
        if not isinstance(model, nn.Module):
            raise TaskError(f"task {task.name!r}: model() must return a torch.nn.Module, got {type(model).__name__}")
        return model

    # ---------------------------------------------------------------- what the Agent sees (rank 0)
    @property
    def model(self) -> nn.Module:
        """Rank 0's whole, unsharded copy of the model (the weights exchanged with the coordinator)."""
        if self._host is None:
            raise RuntimeError("only rank 0 holds the whole model; other ranks call follow()")
        return self._host

    @property
    def num_examples(self) -> int:
        """Size of the agent's local training set (all ranks together train on it once per epoch)."""
        return len(self.train_data)

    def array_specs(self) -> list[Spec]:
        """(name, dtype, shape) of rank 0's whole model."""
        return weight_specs(self.model)

    def set_arrays(self, arrays: list) -> None:
        """Load the round's global weights into rank 0's whole model (train broadcasts them to the shards)."""
        set_weights(self.model, arrays)

    def get_arrays(self) -> list:
        """Rank 0's whole model's weights (train gathers the shards into it)."""
        return get_weights(self.model)

    def holding_task(self, round_id: int) -> contextlib.AbstractContextManager:
        """The span in which the agent holds a task of ``round_id`` (nothing to do)."""
        return contextlib.nullcontext()

    def tasks_queued(self, round_id: int, count: int) -> None:
        """Nothing: the engine agent is its one member."""

    def call_off(self) -> None:
        """Nothing: the engine's ranks stop together at the end of a step, none waits on its own."""

    def warm_up(self) -> None:
        """Nothing to do: every rank already ran one broadcast, zero-lr step and gather when constructed."""

    def evaluate(self) -> EvalResult | None:
        """The task's metrics of rank 0's whole model on the local validation split (None without one)."""
        if self.val is None:
            return None
        return task_eval_result(self.task, self.model, self.val)

    def evaluate_splits(self, splits: Sequence[Any]) -> list[EvalResult | None]:
        """The task's metrics of rank 0's whole model on each of ``splits`` (tasks/evaluation.py
        task_eval_results)."""
        return task_eval_results(self.task, self.model, splits)

    def train(self, epochs: int, batch_size: int, lr: float, stop_at: float = math.inf,
              proximal_mu: float = 0.0, round_id: int = 0, max_steps: int | None = None,
              settings: TaskSettings | None = None) -> TrainResult:
        """Rank 0: train all ranks from ``model``'s weights for ``epochs`` (at most ``max_steps`` steps) or until
        ``stop_at``; ``model`` then holds the result. ``batch_size`` is the agent's whole batch per step, split
        evenly over the data-parallel ranks (so rounded up to a multiple of their number); padding that evens out
        the last batch is not trained on. The task's optimizer is made afresh for each call, as the built-in loop
        of a single-process agent makes it for each round.
        """
        start = time.monotonic()
        if not self._clock.fits(stop_at, self._gather_seconds):
            return StepTally(stopped=True).result(0.0)
        command = Command(TRAIN, epochs, batch_size, lr, proximal_mu, round_id, max_steps or 0)
        self._control.send(command)
        return self._run(command, stop_at, start)

    def shutdown(self) -> None:
        """Rank 0: release the other ranks from :meth:`follow`."""
        self._control.send(Command(SHUTDOWN))

    # ---------------------------------------------------------------- the other ranks
    def follow(self) -> None:
        """Other ranks: run rank 0's commands until it says shutdown."""
        while True:
            command = self._control.receive()
            if command.kind == SHUTDOWN:
                return
            self._run(command, math.inf, time.monotonic())

    # ---------------------------------------------------------------- every rank
    def _run(self, c: Command, stop_at: float, start: float) -> TrainResult:
        load_full_state_dict_from_rank0(self.module, self._host.state_dict() if self._host is not None else {})
        tally = self._train_shard(c, stop_at)
        gather_start = time.monotonic()
        full = gather_full_state_dict(self.module)
        totals = torch.tensor([tally.examples, tally.loss_sum] if self._counts else [0.0, 0.0], dtype=torch.float64,
                              device=self.info.device)
        dist.all_reduce(totals)
        if self._host is not None:
            self._host.load_state_dict(full)
        self._gather_seconds = time.monotonic() - gather_start
        tally.examples, tally.loss_sum = int(totals[0].item()), float(totals[1].item())
        return tally.result(time.monotonic() - start)

    def _sampler(self, batch_size: int, round_id: int) -> tuple[DistributedBatchSampler, int]:
        n = self.num_examples
        local = math.ceil(min(batch_size, n) / self._dp_size)
        sampler = DistributedBatchSampler(n, local, self._dp_size, self._dp_rank, shuffle=False)
        return sampler, local * self._dp_size

    def _train_shard(self, c: Command, stop_at: float) -> StepTally:
        """The one local loop (client/local_loop.py) over this rank's share of each global batch: the task's loss,
        stepped by its optimizer (else plain SGD); rank 0 decides before every step whether to go on, for all."""
        model, task, device = self.module, self.task, self.info.device
        model.train()
        params = trainable(model)
        optimizer = task.optimizer(params, c.lr) if task.optimizer is not None else None
        check_steps_the_model(task, optimizer, params)
        anchor = [p.detach().clone() for p in params] if c.proximal_mu > 0 else None
        sampler, global_batch = self._sampler(c.batch_size, c.round_id)
        n = self.num_examples

        def decide(late: list[int]) -> list[int]:
            return [] if self._control.decide(not late) else [0]

        def step(batch: ShardBatch) -> tuple[int, float]:
            b, (indices, valid) = batch
            real = [i for i, keep in zip(indices, valid.tolist()) if keep]
            # A rank dealt only padding still runs forward and backward (FSDP/DDP collectives need every rank),
            # on the padding, weighted zero.
            inputs, targets = inputs_and_targets(to_device(batch_at(self.train_data, real or indices, task.loader),
                                                           device))
            loss = task.batch_loss(model(inputs), targets)
            examples = batch_examples(targets) if real else 0
            in_batch = min(global_batch, n - b * global_batch)  # examples of this global batch that are not padding
            # DDP/FSDP average gradients over the data-parallel ranks and the loss is the mean over this rank's
            # examples: weighting it by examples * dp / in_batch makes the result the gradient of the mean loss over
            # the global batch's real examples, as one process would compute it. FedProx's proximal term enters as
            # its gradient, shard by shard, with no collective.
            update(params, loss * (examples * self._dp_size / in_batch), c.lr, optimizer, anchor, c.proximal_mu)
            return examples, float(loss.detach()) * examples

        orders = member_orders(n, c.epochs, self.data_seed, c.round_id) if self.shuffle else None
        (tally,) = run_loop(OneMember(self._batches(sampler, c.epochs, c.max_steps, orders), step),
                            [Lane(stop_at, reserve=self._gather_seconds)], self._clock, decide=decide)
        return tally

    @staticmethod
    def _batches(sampler: DistributedBatchSampler, epochs: int, max_steps: int = 0,
                 orders: Iterator[torch.Tensor] | None = None) -> Iterator[ShardBatch]:
        """This rank's batches of every epoch in turn (the first ``max_steps`` of them when it is not 0), each epoch
        in the next of ``orders`` (None: in the data's order)."""
        def every_epoch() -> Iterator[ShardBatch]:
            for epoch in range(epochs):
                sampler.set_epoch(epoch)
                yield from enumerate(sampler.iter_with_padding_mask(next(orders) if orders is not None else None))

        return itertools.islice(every_epoch(), max_steps or None)

    def _warm_up_all_ranks(self) -> None:
        """One broadcast, one zero-lr step on two examples per rank and one gather, so torch's lazy set-up (DDP
        imports torch._dynamo, about 4 s) is not billed to a deadline, and the gather time is known."""
        command = Command(TRAIN, epochs=1, batch_size=min(self.num_examples, 2 * self._dp_size), lr=0.0, max_steps=1)
        self._run(command, math.inf, time.monotonic())
        self._clock = StepClock()  # the first step paid the set-up; measure real steps from scratch
