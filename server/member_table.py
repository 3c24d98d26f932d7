"""Population members at the coordinator as arrays, not a record each: their ids (UTF-8 bytes, sorted: the order of
the ids as strings), the examples each declared first (a later join may lower it, never raise it), the host that
speaks for each and whether it is away. About 30 bytes a member; a member's record is made only when it is asked for.

The live ids (:class:`LiveIds`) are a bit mask over a sorted array of ids (the table's own, shared where it can be)
with a Fenwick tree over the mask's 64-bit blocks (:class:`RankedMask`), so that members going away or coming back
cost O(changed log n) and the k-th live id is found in O(log n), never a copy of the array. About 1/8 byte a member
besides the ids.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

MAX_AGENT_ID = 128
GONE = -1  # the host index of a member whose host left the registry: it stays as its example cap
BLOCK = 64  # positions one Fenwick leaf counts: 8 bytes of the mask


def id_array(ids: Sequence[str]) -> np.ndarray:
    """``ids`` as a bytes array (UTF-8; an id is printable, so holds no NUL that the array would drop)."""
    return np.array([i.encode() for i in ids], dtype=bytes) if len(ids) else np.zeros(0, "S1")


def widest(*arrays: np.ndarray) -> np.dtype:
    """The bytes dtype that holds every element of ``arrays`` (a narrower one would cut ids short)."""
    return np.dtype(f"S{max(1, *(a.dtype.itemsize for a in arrays))}")


def insert_sorted(into: np.ndarray, ids: np.ndarray, *columns: tuple[np.ndarray, np.ndarray]) -> list[np.ndarray]:
    """``into`` with the sorted ``ids`` put in place (and each column's values at the same places)."""
    dtype = widest(into, ids)
    into, ids = into.astype(dtype, copy=False), ids.astype(dtype, copy=False)
    at = np.searchsorted(into, ids)
    return [np.insert(into, at, ids), *(np.insert(column, at, values) for column, values in columns)]


def sorted_unique(ids: np.ndarray) -> np.ndarray:
    """The distinct ``ids``, sorted: a stable sort, which takes runs already in order (a host's members, joined in
    chunks) in about one pass, where np.unique's sort does not (4.8 s against 0.08 s for 4 million ids)."""
    ids = np.sort(ids, kind="stable")
    keep = np.ones(len(ids), bool)
    keep[1:] = ids[1:] != ids[:-1]
    return ids[keep]


def find(sorted_ids: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The positions of ``ids`` in ``sorted_ids`` (-1: not there)."""
    if not len(sorted_ids) or not len(ids):
        return np.full(len(ids), -1, np.int64)
    if ids.dtype.itemsize > sorted_ids.dtype.itemsize:  # widening the sorted array would copy it: longer ids are
        at = np.full(len(ids), -1, np.int64)  # not there
        fits = np.char.str_len(ids) <= sorted_ids.dtype.itemsize
        at[fits] = find(sorted_ids, ids[fits].astype(sorted_ids.dtype))
        return at
    ids = ids.astype(sorted_ids.dtype, copy=False)
    at = np.minimum(np.searchsorted(sorted_ids, ids), len(sorted_ids) - 1)
    return np.where(sorted_ids[at] == ids, at, -1)


def parse_members(member_ids: str, num_examples: Sequence[int], away: Sequence[int],
                  max_examples: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The members of one JoinPopulation (ids separated by newlines, each one's examples, the positions of those
    away) as arrays sorted by id: (ids, example counts, away). ValueError, naming the member, on a bad id, a count
    outside 1..``max_examples``, an id twice, or arrays that do not match."""
    ids = member_ids.split("\n") if member_ids else []
    if len(num_examples) != len(ids):
        raise ValueError(f"{len(ids)} member ids but {len(num_examples)} example counts; send one count per id")
    if ids and not (member_ids.replace("\n", "").isprintable() and min(map(len, ids)) >= 1
                    and max(map(len, ids)) <= MAX_AGENT_ID):
        bad = next(i for i in ids if not (i and len(i) <= MAX_AGENT_ID and i.isprintable()))
        raise ValueError(f"agent_id must be 1..{MAX_AGENT_ID} printable characters, got {bad[:40]!r}")
    sizes = np.asarray(num_examples, np.int64).reshape(-1)
    if len(sizes) and not (sizes.min() >= 1 and sizes.max() <= max_examples):
        at = int(np.argmax((sizes < 1) | (sizes > max_examples)))
        raise ValueError(f"num_examples={sizes[at]} of {ids[at][:40]!r} must be in 1..{max_examples} "
                         "(--max-examples-per-agent)")
    offline = np.zeros(len(ids), bool)
    positions = np.asarray(away, np.int64).reshape(-1)
    if len(positions) and not (positions.min() >= 0 and positions.max() < len(ids)):
        raise ValueError(f"an away position is outside the {len(ids)} member ids of this call")
    offline[positions] = True
    raw = np.array(member_ids.encode().split(b"\n")) if ids else np.zeros(0, "S1")
    order = np.argsort(raw, kind="stable")
    raw, sizes, offline = raw[order], sizes[order], offline[order]
    twice = np.flatnonzero(raw[1:] == raw[:-1])
    if len(twice):
        raise ValueError(f"member {raw[twice[0]].decode()[:40]!r} appears twice in one JoinPopulation")
    return raw, sizes, offline


MERGE_AT = 64  # sorted runs of recent joins kept aside before they are merged into the main one
LOOKUPS_BEFORE_MERGE = 256  # lookups of one member each since the last join that merge the runs


@dataclass
class _Run:
    """Members sorted by id, one row each."""

    ids: np.ndarray  # bytes
    sizes: np.ndarray  # int64: the examples it declared first
    hosts: np.ndarray  # int32: its host's index, GONE once the host left
    away: np.ndarray  # bool

    def take(self, rows) -> _Run:
        """The rows ``rows`` (a mask or positions) as a run."""
        return _Run(self.ids[rows], self.sizes[rows], self.hosts[rows], self.away[rows])


class MemberTable:
    """Every population member the coordinator knows, in sorted runs of rows (ids, example counts, host indices,
    availability); a join adds a run, and runs are merged into the main one (one pass, no sort) once they pile up,
    so a population joined 10,000 members a call costs a few passes over it, not one a call."""

    def __init__(self):
        self._runs: list[_Run] = [_Run(np.zeros(0, "S1"), np.zeros(0, np.int64), np.zeros(0, np.int32),
                                       np.zeros(0, bool))]
        self._lookups = 0  # of one member since the last join: once they outnumber a join's, the runs are merged

    def __len__(self) -> int:
        return sum(len(r.ids) for r in self._runs)

    @property
    def nbytes(self) -> int:
        """Bytes the arrays hold."""
        return sum(r.ids.nbytes + r.sizes.nbytes + r.hosts.nbytes + r.away.nbytes for r in self._runs)

    def _each(self, ids: np.ndarray) -> Iterator[tuple[_Run, np.ndarray, np.ndarray]]:
        """For each run holding some of ``ids``: the run, which of ``ids`` it holds (a mask) and their rows in it."""
        for run in self._runs:
            at = find(run.ids, ids)
            hit = at >= 0
            if hit.any():
                yield run, hit, at[hit]

    def read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For each of ``ids``: whether it is held, and its example count, host index and availability."""
        found, sizes = np.zeros(len(ids), bool), np.zeros(len(ids), np.int64)
        hosts, away = np.full(len(ids), GONE, np.int32), np.zeros(len(ids), bool)
        for run, hit, rows in self._each(ids):
            found[hit], sizes[hit], hosts[hit], away[hit] = True, run.sizes[rows], run.hosts[rows], run.away[rows]
        return found, sizes, hosts, away

    def write(self, ids: np.ndarray, sizes: np.ndarray, host: int, away: np.ndarray) -> None:
        """Set the rows of ``ids`` (all held) to these example counts, host and availability."""
        for run, hit, rows in self._each(ids):
            run.sizes[rows], run.hosts[rows], run.away[rows] = sizes[hit], host, away[hit]

    def row(self, member_id: str) -> tuple[int, int, bool] | None:
        """(example count, host index, away) of ``member_id``, None if not held."""
        return self.rows([member_id])[0]

    def rows(self, member_ids: Sequence[str]) -> list[tuple[int, int, bool] | None]:
        """(example count, host index, away) of each of ``member_ids``, None for one not held: one pass over the runs
        for them all (the runs are merged once the rounds' lookups, a few per sampled member, outnumber the joins')."""
        plain = [i if "\0" not in i else "" for i in member_ids]  # a bytes array drops trailing NULs: "m\0" would
        self._lookups += len(plain)  # find "m" ("" is no member's id)
        if self._lookups > LOOKUPS_BEFORE_MERGE and len(self._runs) > 1:
            self._merge()
        found, sizes, hosts, away = self.read(id_array(plain))
        return [(size, host, off) if hit else None
                for hit, size, host, off in zip(found.tolist(), sizes.tolist(), hosts.tolist(), away.tolist())]

    def add(self, ids: np.ndarray, sizes: np.ndarray, host: int, away: np.ndarray) -> None:
        """Hold ``ids`` (sorted, none held yet) as members of host index ``host``."""
        self._lookups = 0
        if len(ids):
            self._runs.append(_Run(ids, sizes, np.full(len(ids), host, np.int32), away))
        recent = sum(len(r.ids) for r in self._runs[1:])
        if len(self._runs) > MERGE_AT or recent > max(65_536, len(self._runs[0].ids) // 4):
            self._merge()

    def _merge(self) -> _Run:
        """One run: the recent ones sorted together and put in place in the main one."""
        if len(self._runs) > 1:
            main, recent = self._runs[0], self._runs[1:]
            ids = np.concatenate([r.ids for r in recent], dtype=widest(*(r.ids for r in recent)))
            order = np.argsort(ids, kind="stable")
            sizes, hosts, away = (np.concatenate([getattr(r, name) for r in recent])[order]
                                  for name in ("sizes", "hosts", "away"))
            merged = insert_sorted(main.ids, ids[order], (main.sizes, sizes), (main.hosts, hosts), (main.away, away))
            self._runs = [_Run(*merged)]
        return self._runs[0]

    def set_away(self, ids: np.ndarray, host: int, flag: bool) -> np.ndarray:
        """Mark those of ``ids`` that are members of host index ``host`` away (``flag``) or back; returns the ids
        whose availability changed."""
        changed = []
        for run, hit, rows in self._each(ids):
            mine = rows[(run.hosts[rows] == host) & (run.away[rows] != flag)]
            run.away[mine] = flag
            changed.append(run.ids[mine])
        return np.concatenate(changed) if changed else np.zeros(0, "S1")

    def live(self, hosts_live: np.ndarray, excluded: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The sorted ids of the members whose host is held (the table's own array, unless some host left) and which
        of them are live: not away, their host index set in ``hosts_live``, not in ``excluded``."""
        run = self._merge()
        held = run.hosts != GONE
        if not held.all():
            run = run.take(held)
        live = hosts_live[run.hosts] & ~run.away
        out = find(run.ids, excluded)
        live[out[out >= 0]] = False
        return run.ids, live

    def forget_hosts(self, indices: list[int], keep_at_most: int) -> None:
        """The hosts of ``indices`` left: their members stay as example caps, up to ``keep_at_most`` such members."""
        gone = 0
        for run in self._runs:
            run.hosts[np.isin(run.hosts, indices)] = GONE
            gone += int((run.hosts == GONE).sum())
        if gone > keep_at_most:
            run = self._merge()
            self._runs = [run.take(run.hosts != GONE)]


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
