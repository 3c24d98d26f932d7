"""One client's local data: its partition of the training set, split into train and validation."""

from __future__ import annotations

import numpy as np

from fedpar.datasets import ArrayDataset, DatasetSplits
from fedpar.datasets.partition import AUTO, parse_partition
from fedpar.wording import counted


def resolve_partition(spec: str, splits: DatasetSplits) -> str:
    """``spec``, with "auto" made "natural" for data whose examples have owners (synthetic, tables with a client
    column) and "iid" for the rest; "natural" in any letters (as parse_partition takes the others) is "natural"."""
    key = spec.strip().lower()
    if key == "natural":
        return key
    if key != AUTO:
        return spec
    return "natural" if splits.members is not None or splits.train_owners is not None else "iid"


def partition_indices(splits: DatasetSplits, spec: str, num_clients: int, seed: int) -> list[np.ndarray]:
    """Index arrays of every client's share of the training set under partition ``spec`` ("natural": each
    client's own examples, for data that has owners; "auto": natural for such data, else iid)."""
    spec = resolve_partition(spec, splits)
    if spec == "natural" and splits.members is not None:  # the pool is the members' examples, member by member
        sizes = splits.members.sizes
        if len(sizes) != num_clients:
            raise ValueError(f"the data has {counted(len(sizes), 'client')} of its own; run it with --clients "
                             f"{len(sizes)}")
        return np.split(np.arange(int(sizes.sum()), dtype=np.int64), np.cumsum(sizes)[:-1])
    if spec == "natural":
        owners = splits.train_owners
        if owners is None:
            raise ValueError("--partition natural needs data whose examples have owners (synthetic, or a table with "
                             "a 'client' column saying who wrote each example); use iid, dirichlet:ALPHA or shards:K")
        found = int(owners.max()) + 1 if len(owners) else 0
        if found != num_clients:
            raise ValueError(f"the data has {counted(found, 'client')} of its own; run it with --clients {found}")
        order = np.argsort(owners, kind="stable")
        return np.split(order.astype(np.int64), np.cumsum(np.bincount(owners, minlength=found))[:-1])
    return parse_partition(spec)(splits.train.y, num_clients, seed)


def client_parts(splits: DatasetSplits, spec: str, num_clients: int, seed: int,
                 examples_per_client: int | None = None) -> list[np.ndarray]:
    """:func:`partition_indices`, each client keeping at most ``examples_per_client`` of its examples (a random
    choice of them; None: all), so that populations of different sizes can hold clients of the same size."""
    parts = partition_indices(splits, spec, num_clients, seed)
    if examples_per_client is None:
        return parts
    if examples_per_client < 1:
        raise ValueError("--examples-per-client must be >= 1")
    rng = np.random.default_rng([seed, 7])
    return [np.sort(rng.choice(p, examples_per_client, replace=False)) if len(p) > examples_per_client else p
            for p in parts]


def local_train_size(examples, val_fraction: float):
    """How many of a client's ``examples`` :func:`local_split` keeps for training (of each client's, for an array):
    one at least (a large --val-fraction of a small client rounded to all of them, leaving it none to train on)."""
    if isinstance(examples, np.ndarray):
        held = np.minimum(np.round(examples * val_fraction).astype(np.int64), examples - 1)
        return examples - np.where(examples > 1, held, 0)
    return examples - (min(int(round(examples * val_fraction)), examples - 1) if examples > 1 else 0)


def local_split(train: ArrayDataset, indices: np.ndarray, val_fraction: float,
                seed: int) -> tuple[ArrayDataset, ArrayDataset | None]:
    """Split one client's examples into local train and validation sets (for federated evaluation)."""
    train_idx, val_idx = split_indices(indices, val_fraction, seed)
    return train.subset(train_idx), (train.subset(val_idx) if len(val_idx) else None)


def split_indices(indices: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One client's example indices shuffled by ``seed`` and cut into (train, validation) as :func:`local_split`
    cuts them (for any dataset that can be indexed)."""
    if not 0 <= val_fraction < 1:
        raise ValueError("val_fraction must be in [0, 1)")
    order = np.random.default_rng(seed).permutation(np.asarray(indices))
    n_val = len(order) - local_train_size(len(order), val_fraction)
    return order[n_val:], order[:n_val]


def label_counts(parts: list[np.ndarray], labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Examples of each class (columns) held by each client (rows)."""
    counts = np.zeros((len(parts), num_classes), np.int64)
    if parts:
        owners = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
        np.add.at(counts, (owners, labels[np.concatenate(parts)]), 1)
    return counts


def label_skew(parts: list[np.ndarray], labels: np.ndarray, num_classes: int) -> dict[str, float]:
    """How label-skewed a partition is: classes a client holds on average, and the mean share of its largest (a
    client of no examples: none, and a share of 0). Counted over the (client, class) pairs that occur, not a table of
    every class (2,000 clients of 65,536 classes would be 1 GB)."""
    if not parts:
        return {"mean_classes_per_client": 0.0, "mean_top_class_share": 0.0}
    sizes = np.fromiter((len(p) for p in parts), np.int64, len(parts))
    owners = np.repeat(np.arange(len(parts)), sizes)
    held = np.concatenate(parts).astype(np.int64) if sizes.sum() else np.zeros(0, np.int64)
    pairs, counts = np.unique(owners * np.int64(num_classes) + labels[held], return_counts=True)
    owner = pairs // num_classes
    top = np.zeros(len(parts), np.int64)
    np.maximum.at(top, owner, counts)
    return {"mean_classes_per_client": float(np.bincount(owner, minlength=len(parts)).mean()),
            "mean_top_class_share": float((top / np.maximum(sizes, 1)).mean())}
