"""The coordinator's live ids: a bit mask over a sorted array of ids (the member table's own, shared where it can be)
with a Fenwick tree over the mask's 64-bit blocks, so that members going away or coming back cost O(changed log n)
and the k-th live id is found in O(log n), never a copy of the array. About 1/8 byte a member besides the ids."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedpar.server.member_table import find, id_array, insert_sorted, sorted_unique, widest

BLOCK = 64  # positions one Fenwick leaf counts: 8 bytes of the mask


class RankedMask:
    """A bit mask over ``size`` positions with a Fenwick tree over its blocks' counts: setting or clearing k bits
    costs O(k log n), the positions of k ranks O(k log n) (vectorised), the count O(1)."""

    def __init__(self, mask: np.ndarray):
        self.size = len(mask)
        blocks = -(-self.size // BLOCK)
        self._bytes = np.zeros(blocks * (BLOCK // 8), np.uint8)
        packed = np.packbits(mask, bitorder="little")
        self._bytes[:len(packed)] = packed
        counts = np.bitwise_count(self._bytes.view("<u8")).astype(np.int64)
        prefix = np.concatenate([[0], np.cumsum(counts)])
        leaf = np.arange(1, blocks + 1)
        self._tree = np.zeros(blocks + 1, np.int32)  # 1-based: leaf i counts blocks (i - lowbit(i), i]
        self._tree[1:] = prefix[leaf] - prefix[leaf - (leaf & -leaf)]
        self.count = int(prefix[-1])

    @property
    def nbytes(self) -> int:
        """Bytes the mask and its index hold."""
        return self._bytes.nbytes + self._tree.nbytes

    def mask(self) -> np.ndarray:
        """The mask as a bool array (a pass over it)."""
        return np.unpackbits(self._bytes, count=self.size, bitorder="little").view(bool)

    def test(self, positions: np.ndarray) -> np.ndarray:
        """Whether each of ``positions`` is set."""
        positions = np.asarray(positions, np.int64)
        return ((self._bytes[positions >> 3] >> (positions & 7).astype(np.uint8)) & 1) == 1

    def assign(self, positions: np.ndarray, flag: bool) -> int:
        """Set (``flag``) or clear the bits at ``positions``; returns how many changed."""
        positions = np.unique(np.asarray(positions, np.int64))
        flip = positions[self.test(positions) != flag]
        if not len(flip):
            return 0
        bits = np.left_shift(np.uint8(1), (flip & 7).astype(np.uint8))
        if flag:
            np.bitwise_or.at(self._bytes, flip >> 3, bits)
        else:
            np.bitwise_and.at(self._bytes, flip >> 3, ~bits)
        delta = 1 if flag else -1
        leaf, top = flip // BLOCK + 1, len(self._tree) - 1
        while len(leaf):
            np.add.at(self._tree, leaf, delta)
            leaf = leaf + (leaf & -leaf)
            leaf = leaf[leaf <= top]
        self.count += delta * len(flip)
        return len(flip)

    def select(self, ranks: np.ndarray) -> np.ndarray:
        """The positions of the set bits of ``ranks`` (0-based among the set bits, each below :attr:`count`)."""
        ranks = np.asarray(ranks, np.int64)
        top = len(self._tree) - 1
        block, left = np.zeros(len(ranks), np.int64), ranks + 1  # left: the rank within what is left, 1-based
        step = 1 << (top.bit_length() - 1) if top else 0
        while step:  # the last block whose prefix count stays below each rank: the one holding it is next
            ahead = block + step
            counts = np.where(ahead <= top, self._tree[np.minimum(ahead, top)], 0)
            go = (ahead <= top) & (counts < left)
            block, left = np.where(go, ahead, block), np.where(go, left - counts, left)
            step >>= 1
        octets = self._bytes[block[:, None] * (BLOCK // 8) + np.arange(BLOCK // 8)]
        bits = np.unpackbits(octets, axis=1, bitorder="little")
        return block * BLOCK + np.argmax(np.cumsum(bits, axis=1) >= left[:, None], axis=1)


class LiveIds(Sequence):
    """The ids of the live agents and members in sorted order: a :class:`RankedMask` over a sorted bytes array of
    the ids that may be live (never written: it may be the member table's own). Going away or coming back flips
    bits; ids not in the array yet (new joins) wait aside and are merged in when the ids are next read, so
    counting them and sampling a cohort from them costs no pass over the population while it stays as it was."""

    def __init__(self, ids: np.ndarray, live: np.ndarray, key: object, valid_until: float):
        self._ids, self._live, self._added = ids, RankedMask(live), []
        self.key, self.valid_until = key, valid_until  # what it was made from, and until when it holds

    def _merged(self) -> LiveIds:
        if self._added:
            added = sorted_unique(np.concatenate(self._added, dtype=widest(*self._added)))
            self._added = []
            at = find(self._ids, added)
            self._live.assign(at[at >= 0], True)
            new = added[at < 0]
            if len(new):
                self._ids, mask = insert_sorted(self._ids, new, (self._live.mask(), np.ones(len(new), bool)))
                self._live = RankedMask(mask)
        return self

    @property
    def index_bytes(self) -> int:
        """Bytes the mask and its index hold (the ids are the member table's array, or a copy where hosts left)."""
        return self._live.nbytes

    def __len__(self) -> int:
        return self._live.count + sum(len(a) for a in self._added)

    def array(self) -> np.ndarray:
        """The ids as a sorted bytes array (UTF-8; a pass over them)."""
        self._merged()
        return self._ids[self._live.mask()]

    def take(self, positions: Sequence[int]) -> list[str]:
        """The ids at ``positions`` (each in 0..len-1) of the sorted live ids: O(len(positions) log n)."""
        self._merged()
        positions = np.asarray(positions, np.int64)
        if len(positions) and not (positions.min() >= 0 and positions.max() < self._live.count):
            raise IndexError(f"live id position out of range 0..{self._live.count - 1}")
        return [i.decode() for i in self._ids[self._live.select(positions)].tolist()] if len(positions) else []

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.take(range(len(self))[index])
        count = len(self)
        if not -count <= index < count:
            raise IndexError(f"live id {index} of {count}")
        return self.take([index % count])[0]

    def __iter__(self):
        return (i.decode() for i in self.array().tolist())

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (list, tuple, LiveIds)) else NotImplemented

    __hash__ = None  # it changes

    def __contains__(self, agent_id: object) -> bool:
        if not isinstance(agent_id, str):
            return False
        at = find(self._merged()._ids, id_array([agent_id]))
        return bool(at[0] >= 0 and self._live.test(at)[0])

    def add(self, ids: np.ndarray) -> None:
        """Take ``ids`` (bytes), live now and not held yet."""
        if len(ids):
            at = find(self._ids, ids)
            self._live.assign(at[at >= 0], True)
            if (at < 0).any():
                self._added.append(ids[at < 0])

    def discard(self, ids: np.ndarray) -> None:
        """Drop those of ``ids`` (bytes) that are held."""
        if len(ids):
            at = find(self._merged()._ids, ids)
            self._live.assign(at[at >= 0], False)
