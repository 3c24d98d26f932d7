"""A task's data in the built-in loop: a client's share of a dataset, batches of it, and moving them to a device.

In-memory datasets (``fedpar.datasets.ArrayDataset``, ``torch.utils.data.TensorDataset``) are batched by indexing
their tensors, kept on the training device (what a ``DataLoader`` would do item by item, without its per-item
cost); any other map-style dataset goes through a ``torch.utils.data.DataLoader``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from fedpar.datasets import ArrayDataset
from fedpar.datasets.clientdata import split_indices
from fedpar.datasets.partition import AUTO, parse_partition
from fedpar.task import ClientData, Partition, TaskError


def in_memory(dataset: Any) -> tuple[torch.Tensor, ...] | None:
    """The tensors behind an in-memory dataset (ArrayDataset, TensorDataset), else None."""
    if isinstance(dataset, ArrayDataset):
        return dataset.to_tensors()
    if isinstance(dataset, TensorDataset):
        return tuple(dataset.tensors)
    return None


def on_device(dataset: Any, device: torch.device | str) -> Any:
    """``dataset`` with its tensors on ``device`` when it is in memory (kept there for the trainer's life)."""
    tensors = in_memory(dataset)
    if tensors is None:
        return dataset
    device = torch.device(device)
    if all(t.device == device for t in tensors):  # no torch call per tensor (each gives up the interpreter lock)
        return dataset if type(dataset) is TensorDataset else TensorDataset(*tensors)
    return TensorDataset(*(t.to(device) for t in tensors))


def labels_of(dataset: Any) -> np.ndarray | None:
    """Integer class labels of an in-memory (inputs, labels) dataset, else None."""
    tensors = in_memory(dataset)
    if tensors is None or len(tensors) != 2 or tensors[1].ndim != 1 or torch.is_floating_point(tensors[1]):
        return None
    return tensors[1].cpu().numpy()


def share_of(dataset: Any, partition: Partition) -> ClientData:
    """Client ``partition.index``'s share of ``dataset`` as the partition says (iid, or dirichlet/shards on
    integer labels), with ``partition.val_fraction`` of it kept for federated evaluation."""
    if not isinstance(partition, Partition):
        raise TypeError(f"share_of takes a fedpar.Partition(index, count), got {type(partition).__name__}")
    labels = labels_of(dataset)
    if labels is None:
        if partition.scheme not in ("iid", AUTO):
            raise TaskError(f"--partition {partition.scheme} needs integer class labels; this task's data has none "
                            "fedpar can read (use iid, or split the data in the task's client_data)")
        labels = np.zeros(len(dataset), np.int64)
    parts = parse_partition(partition.scheme)(labels, partition.count, partition.seed)
    train, val = split_indices(parts[partition.index], partition.val_fraction, partition.seed)
    return ClientData(subset(dataset, train), subset(dataset, val) if len(val) else None)


def subset(dataset: Any, indices: np.ndarray) -> Any:
    """The examples of ``dataset`` at ``indices`` (an in-memory copy for in-memory data, else a view)."""
    if isinstance(dataset, ArrayDataset):
        return dataset.subset(indices)
    tensors = in_memory(dataset)
    if tensors is not None:
        idx = torch.as_tensor(np.asarray(indices, np.int64))
        return TensorDataset(*(t[idx] for t in tensors))
    return Subset(dataset, [int(i) for i in indices])


def default_batches(dataset: Any, batch_size: int, generator: torch.Generator | None = None) -> Iterator:
    """One epoch of ``dataset`` in batches of ``batch_size``: shuffled by ``generator``, in order without one."""
    tensors = in_memory(dataset)
    if tensors is None:
        yield from DataLoader(dataset, batch_size=batch_size, shuffle=generator is not None, generator=generator)
        return
    n = len(tensors[0])
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    if tensors[0].device.type != "cpu":
        order = order.to(tensors[0].device)  # drawn on the CPU: the same order on any device
    for begin in range(0, n, batch_size):
        idx = order[begin:begin + batch_size]
        yield tuple(t[idx] for t in tensors)


def batch_at(dataset: Any, indices: list[int], loader: Any = None) -> Any:
    """The examples of ``dataset`` at ``indices`` as one batch, in that order: batched by the task's ``loader``
    when it has one (given just those examples, no generator), else as :func:`default_batches` batches them."""
    tensors = in_memory(dataset) if loader is None else None
    if tensors is not None:
        idx = torch.as_tensor(indices, dtype=torch.int64, device=tensors[0].device)
        return tuple(t[idx] for t in tensors)
    return next(iter((loader or default_batches)(subset(dataset, np.asarray(indices, np.int64)), len(indices), None)))


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (a tensor, or tuples, lists and dicts of them) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def inputs_and_targets(batch: Any) -> tuple[Any, Any]:
    """The (inputs, targets) pair of a batch of the built-in loop; TaskError for any other shape."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TaskError(f"the built-in loop needs batches of (inputs, targets); this task's loader gave a "
                    f"{type(batch).__name__}{f' of {len(batch)}' if isinstance(batch, (tuple, list)) else ''}: "
                    "give the task a loader that yields pairs, or its own train hook")


def batch_examples(targets: Any) -> int:
    """How many examples a batch's targets hold (their first dimension)."""
    if isinstance(targets, torch.Tensor):
        return int(targets.shape[0]) if targets.ndim else 1
    return len(targets)
