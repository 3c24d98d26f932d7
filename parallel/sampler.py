"""A distributed batch sampler: reshuffles every epoch and gives every rank the same number of batches."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch


class DistributedBatchSampler:
    """Yields lists of dataset indices for one data-parallel rank.

    Every epoch draws one permutation from ``seed + epoch`` (identical on all ranks), pads it by wrapping
    around so it divides evenly, and deals consecutive batches round-robin to the ranks. All ranks therefore
    run the same number of steps, so no rank waits in a collective that the others never reach.
    ``start_batch`` skips batches already consumed in the current epoch (resume in the middle of an epoch).
    """

    def __init__(self, dataset_size: int, batch_size: int, num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        """``batch_size`` is per rank; ``drop_last`` drops the final incomplete global batch instead of padding."""
        if dataset_size < 1:
            raise ValueError("the dataset is empty; point the trainer at a dataset with at least one example")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")
        if drop_last and dataset_size < batch_size * num_replicas:
            raise ValueError(f"drop_last leaves no batches: {dataset_size} examples < {batch_size} x {num_replicas}")
        self.dataset_size, self.batch_size = dataset_size, batch_size
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.start_batch = 0

    def __len__(self) -> int:
        """Batches per epoch for each rank (the same on every rank)."""
        global_batch = self.batch_size * self.num_replicas
        if self.drop_last:
            return self.dataset_size // global_batch
        return math.ceil(self.dataset_size / global_batch)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch's permutation, optionally skipping the first ``start_batch`` batches."""
        self.epoch, self.start_batch = epoch, start_batch

    def _epoch_order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.dataset_size)
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=g)

    def iter_with_padding_mask(self, order: torch.Tensor | None = None) -> Iterator[tuple[list[int], torch.Tensor]]:
        """Like iteration, plus a bool mask that is False for wrapped-around padding (for exact evaluation); the
        epoch in ``order`` (a permutation of the dataset's indices) when one is given, else in the sampler's own."""
        order = self._epoch_order() if order is None else order
        total = len(self) * self.batch_size * self.num_replicas
        if total > len(order):
            order = order.repeat(math.ceil(total / len(order)))
        position = torch.arange(total).view(len(self), self.num_replicas, self.batch_size)
        order = order[:total].view(len(self), self.num_replicas, self.batch_size)
        for b in range(self.start_batch, len(self)):
            yield order[b, self.rank].tolist(), position[b, self.rank] < self.dataset_size

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's batches for the current epoch, from ``start_batch`` on."""
        for indices, _ in self.iter_with_padding_mask():
            yield indices
