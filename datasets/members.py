"""Each client's ("member's") examples, made only when that member is asked for, the same in every process.

- :class:`PooledMembers`: a partition of a training set (IID, Dirichlet, shards, quantity, or the examples' own
  owners for tables with a client column) as index arrays over one shared copy of the examples (for MNIST a
  read-only memory map every process shares): one int64 array of every member's indices and one of offsets,
  8 bytes per example plus 8 per member, never a copy of the examples per member or per process;
- data that makes one member's examples by itself (synthetic, from (seed, member)) is its own source
  (``DatasetSplits.members``), for ``--partition natural``.

A source has ``sizes`` (each member's examples, int64), ``examples(k)`` and ``labels(k)``; :func:`member_source`
picks it.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from fedpar.datasets.arrays import ArrayDataset, DatasetSplits, Examples
from fedpar.datasets.clientdata import client_parts, resolve_partition
from fedpar.wording import counted


class MemberSource(Protocol):
    """Members' examples on demand: ``sizes[k]`` examples for member k, made by ``examples(k)``."""

    sizes: np.ndarray

    def examples(self, k: int) -> ArrayDataset:
        """All of member ``k``'s examples (before its validation share is kept apart)."""

    def labels(self, k: int) -> np.ndarray:
        """Member ``k``'s labels."""


class PooledMembers:
    """Members as index arrays into one shared ``pool`` of examples: member k holds
    ``pool[order[offsets[k]:offsets[k + 1]]]``."""

    def __init__(self, pool: Examples, parts: list[np.ndarray]):
        self.pool = pool
        self.sizes = np.fromiter((len(p) for p in parts), np.int64, len(parts))
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.order = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def __len__(self) -> int:
        """Number of members."""
        return len(self.sizes)

    def indices(self, k: int) -> np.ndarray:
        """Member ``k``'s examples' indices in the pool."""
        return self.order[self.offsets[k]:self.offsets[k + 1]]

    def examples(self, k: int) -> ArrayDataset:
        """Member ``k``'s examples, copied out of the pool."""
        return self.pool.subset(self.indices(k))

    def labels(self, k: int) -> np.ndarray:
        """Member ``k``'s labels (no example is decoded)."""
        return self.pool.y[self.indices(k)]

    @property
    def nbytes(self) -> int:
        """Bytes of the index arrays (the pool is shared, not counted)."""
        return int(self.sizes.nbytes + self.offsets.nbytes + self.order.nbytes)


class CappedMembers:
    """At most ``cap`` examples of each member of ``source``: a random choice of them drawn from (seed, member), so
    that populations of different sizes can hold clients of the same size."""

    def __init__(self, source: MemberSource, cap: int, seed: int):
        self.source, self.cap, self.seed = source, cap, seed
        self.sizes = np.minimum(source.sizes, cap)

    def __len__(self) -> int:
        """Number of members."""
        return len(self.sizes)

    def examples(self, k: int) -> ArrayDataset:
        """Member ``k``'s examples, at most ``cap`` of them."""
        data = self.source.examples(k)
        if len(data) <= self.cap:
            return data
        return data.subset(np.sort(np.random.default_rng([self.seed, 7, k]).choice(len(data), self.cap, False)))

    def labels(self, k: int) -> np.ndarray:
        """Member ``k``'s labels."""
        return self.examples(k).y


def member_source(splits: DatasetSplits, spec: str, num_clients: int, seed: int,
                  examples_per_client: int | None = None) -> MemberSource:
    """The members of a federation of ``num_clients`` over ``splits`` under partition ``spec`` (see
    :func:`fedpar.datasets.clientdata.client_parts`): the data's own members when it makes them by itself and the
    partition is natural, else index arrays over the shared training set."""
    spec = resolve_partition(spec, splits)
    members = splits.members
    if spec == "natural" and members is not None:
        if len(members.sizes) != num_clients:
            raise ValueError(f"the data has {counted(len(members.sizes), 'client')} of its own; run it with "
                             f"--clients {len(members.sizes)}")
        if examples_per_client is not None:
            if examples_per_client < 1:
                raise ValueError("--examples-per-client must be >= 1")
            return CappedMembers(members, examples_per_client, seed)
        return members
    return PooledMembers(splits.train, client_parts(splits, spec, num_clients, seed, examples_per_client))

