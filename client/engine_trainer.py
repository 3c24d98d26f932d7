"""Local training for agents that are a process group of their own, on the shared parallel engine (FSDP/DDP/TP).

Rank 0 is the one the :class:`~fedpar.client.agent.Agent` drives: it holds a plain, whole copy of the model
(``model``: what the agent downloads into, evaluates and uploads from). ``train`` broadcasts that copy to
the sharded model on every rank, trains all ranks on their shards of the local data, and gathers the result
back into it. The other ranks sit in :meth:`EngineTrainer.follow` until rank 0 says shutdown.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from fedpar.client.engine_control import SHUTDOWN, TRAIN, Command, ControlChannel
from fedpar.client.local_sgd import StepClock, StepTally, TrainResult, descend, run_steps
from fedpar.datasets import ArrayDataset
from fedpar.models.evaluation import EvalResult, evaluate_classifier
from fedpar.models.losses import classification_loss
from fedpar.parallel.checkpoint import gather_full_state_dict, load_full_state_dict_from_rank0
from fedpar.parallel.config import ConfigurationError, ParallelConfig
from fedpar.parallel.init import DistInfo
from fedpar.parallel.mesh import build_mesh
from fedpar.parallel.parallelize import parallelize
from fedpar.parallel.sampler import DistributedBatchSampler

ShardBatch = tuple[int, tuple[list[int], torch.Tensor]]  # batch number in its epoch, (this rank's indices, not-padding)


class EngineTrainer:
    """The LocalTrainer interface (train/evaluate/num_examples/model/warm_up/holding_task) over a sharded model.

    Construct on every rank of the group at once (it is collective); then rank 0 hands itself to an Agent
    and calls :meth:`shutdown` when the agent is done, while every other rank calls :meth:`follow`.
    """

    def __init__(self, model_fn: Callable[[], nn.Module], family: str, train: ArrayDataset,
                 val: ArrayDataset | None, info: DistInfo, parallel: ParallelConfig, seed: int = 0,
                 shuffle: bool = True, idle_timeout_seconds: float = 7 * 86400.0):
        """Shard ``model_fn()`` over the group as ``parallel`` says (pp must be 1) and warm everything up."""
        config = parallel.resolved(info.world_size)
        if config.pp > 1:
            raise ConfigurationError("agents train with --dp-replicate/--fsdp/--tp; pipeline parallelism (--pp) is not "
                                     "supported for agents, use --fsdp to spread a large model instead")
        self.info, self.seed, self.shuffle = info, seed, shuffle
        self.mesh = build_mesh(config, info.device.type)
        self._dp_size, self._dp_rank = config.data_parallel_size, self.mesh.data_parallel_rank
        self._counts = self.mesh.coord("tp") == 0  # TP peers see the same examples: count them once
        self.module = parallelize(model_fn, family, config, self.mesh, info, classification_loss, seed).parts[0]
        self._host = model_fn() if info.is_main else None
        self._control = ControlChannel(info.device, idle_timeout_seconds)
        self.x, self.y = train.to_tensors()
        self.val = val.to_tensors() if val is not None and len(val) and info.is_main else None
        self._clock = StepClock()
        self._gather_seconds = 0.0
        self._warm_up_all_ranks()

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
        return len(self.y)

    def holding_task(self, round_id: int) -> contextlib.AbstractContextManager:
        """The span in which the agent holds a task of ``round_id`` (as LocalTrainer: nothing to do)."""
        return contextlib.nullcontext()

    def warm_up(self) -> None:
        """Nothing to do: every rank already ran one broadcast, zero-lr step and gather when constructed."""

    @torch.no_grad()
    def evaluate(self, batch_size: int = 1024) -> EvalResult | None:
        """Loss and accuracy of rank 0's whole model on the local validation split (None without one)."""
        if self.val is None:
            return None
        return evaluate_classifier(self.model, *self.val, batch_size=batch_size)

    def train(self, epochs: int, batch_size: int, lr: float, stop_at: float = math.inf,
              proximal_mu: float = 0.0, round_id: int = 0) -> TrainResult:
        """Rank 0: train all ranks from ``model``'s weights for ``epochs`` or until ``stop_at``; ``model`` then
        holds the result. ``batch_size`` is the agent's whole batch per step, split evenly over the data-parallel
        ranks (so rounded up to a multiple of their number); padding that evens out the last batch is not trained on.
        """
        start = time.monotonic()
        if not self._clock.fits(stop_at, self._gather_seconds):
            return StepTally(stopped=True).result(0.0)
        command = Command(TRAIN, epochs, batch_size, lr, proximal_mu, round_id)
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
        n = len(self.y)
        local = math.ceil(min(batch_size, n) / self._dp_size)
        # Seeds of neighbouring rounds must not overlap: the sampler adds the epoch to its seed.
        seed = (self.seed * 1_000_003 + round_id) * 10_007
        sampler = DistributedBatchSampler(n, local, self._dp_size, self._dp_rank, shuffle=self.shuffle, seed=seed)
        return sampler, local * self._dp_size

    def _train_shard(self, c: Command, stop_at: float) -> StepTally:
        """SGD over this rank's shard of each global batch; rank 0 decides before every step whether to go on."""
        model = self.module
        model.train()
        params = list(model.parameters())
        anchor = [p.detach().clone() for p in params] if c.proximal_mu > 0 else None
        sampler, global_batch = self._sampler(c.batch_size, c.round_id)
        n = len(self.y)

        def go_on() -> bool:
            return self._control.decide(self._clock.fits(stop_at, self._gather_seconds))

        def step(batch: ShardBatch) -> tuple[int, float]:
            b, (indices, valid) = batch
            idx = torch.tensor(indices)
            x, y = self.x[idx].to(self.info.device), self.y[idx].to(self.info.device)
            weight = valid.to(device=self.info.device, dtype=torch.float32)
            per_example = classification_loss(model(x), y, reduction="none")
            real = min(global_batch, n - b * global_batch)  # examples of this global batch that are not padding
            # DDP/FSDP average gradients over the data-parallel ranks; scaling by dp/real makes the result
            # the gradient of the mean loss over the real examples, as one process would compute it.
            loss = (per_example * weight).sum() * (self._dp_size / real)
            # FedProx's proximal term enters as its gradient, shard by shard, with no collective.
            descend(params, loss, c.lr, anchor, c.proximal_mu)
            return int(valid.sum()), float((per_example.detach() * weight).sum())

        return run_steps(self._batches(sampler, c.epochs), step, go_on, self._clock)

    @staticmethod
    def _batches(sampler: DistributedBatchSampler, epochs: int) -> Iterator[ShardBatch]:
        """This rank's batches of every epoch in turn."""
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            yield from enumerate(sampler.iter_with_padding_mask())

    def _warm_up_all_ranks(self) -> None:
        """One broadcast, one zero-lr step on two examples per rank and one gather, so torch's lazy set-up (DDP
        imports torch._dynamo, about 4 s) is not billed to a deadline, and the gather time is known."""
        command = Command(TRAIN, epochs=1, batch_size=min(len(self.y), 2 * self._dp_size), lr=0.0)
        self._run(command, math.inf, time.monotonic())
        self._clock = StepClock()  # the first step paid the set-up; measure real steps from scratch
