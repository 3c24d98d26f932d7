"""The model, the data and the training and evaluation loops of digits-app (no downloads: fedpar's bundled digits)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from torch import nn

from fedpar.datasets import load_digits
from fedpar.datasets.partition import partition_iid


class Net(nn.Module):
    """A tiny MLP: 64 pixels -> 32 -> 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


@lru_cache(maxsize=1)
def _digits():
    return load_digits(test_fraction=0.2, seed=0)


def load_data(partition_id: int, num_partitions: int) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                              tuple[torch.Tensor, torch.Tensor]]:
    """Partition ``partition_id`` of ``num_partitions`` (IID) of the digits' training split, cut 80/20 into this
    node's train and validation tensors."""
    splits = _digits()
    share = partition_iid(len(splits.train), num_partitions, seed=42)[partition_id]
    x, y = splits.train.x[share], splits.train.y[share]
    cut = int(0.8 * len(share))
    as_tensors = lambda a, b: (torch.from_numpy(np.ascontiguousarray(a)), torch.from_numpy(b))  # noqa: E731
    return as_tensors(x[:cut], y[:cut]), as_tensors(x[cut:], y[cut:])


def train_size(partition_id: int, num_partitions: int) -> int:
    """How many training examples partition ``partition_id`` holds."""
    return len(load_data(partition_id, num_partitions)[0][1])


def load_centralized_test() -> tuple[torch.Tensor, torch.Tensor]:
    """The digits' held-out test split (the ServerApp's evaluation)."""
    test = _digits().test
    return torch.from_numpy(np.ascontiguousarray(test.x)), torch.from_numpy(test.y)


def train(net: Net, data: tuple[torch.Tensor, torch.Tensor], epochs: int, lr: float, batch_size: int,
          seed: int) -> float:
    """Plain SGD for ``epochs`` over shuffled batches (shuffled by ``seed``: the same run twice is the same); the
    mean training loss."""
    x, y = data
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    net.train()
    total, batches = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y), batch_size):
            idx = order[start:start + batch_size]
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
    return total / max(1, batches)


@torch.no_grad()
def test(net: Net, data: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """Mean loss and accuracy of ``net`` on ``data``."""
    x, y = data
    net.eval()
    logits = net(x)
    return float(nn.functional.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())
