"""Whole-example counts for drawn shares: each class's examples dealt to clients in its drawn proportions, rounded so
that a class is dealt out exactly, a client's count of a class is the floor or the ceiling of its share of it, and a
client's total is the floor or the ceiling of its total share (controlled rounding of a matrix, as in Bacharach 1966).

Rounding each class on its own (a floor of the cumulative shares, say) keeps the first and the rest, but its errors of
up to one example a class add up over the classes: at a huge Dirichlet alpha two clients of 200 examples in 20 classes
got 90 and 110 where the drawn shares said 100 each. Here the shares are exact integers in units of 1/SCALE of an
example. Pairs of classes (of clients, where classes outnumber clients twice over) first trade their fractions within
the clients (classes) where both are fractional, by pipage rounding over numpy arrays, until any two share at most one
such entry; then dependent rounding (Gandhi et al. 2006: shifts along the cycles and paths of the fractional entries)
settles the few left. Every shift of either kind is up or down at random with zero mean, so each count keeps its share
as its expectation (on 3 x 9 and 20 x 4 matrices, 4,000 draws each, every mean count was within 0.02 of its share).
"""

from __future__ import annotations

import numpy as np

SCALE = 1 << 24  # a share's resolution: 1/SCALE of an example (counts up to 2^39 a class fit in int64)


def round_shares(proportions: np.ndarray, totals: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Integer counts (classes, clients) for ``proportions`` (classes, clients; each row non-negative, summing to
    about 1) of ``totals`` examples a class: row c sums to ``totals[c]``, each count is the floor or the ceiling of
    its share ``proportions[c, k] * totals[c]``, and each column sums to the floor or the ceiling of its shares."""
    shares = _scaled(np.asarray(proportions, np.float64), np.asarray(totals, np.int64))
    counts, fractions = np.divmod(shares, SCALE)
    classes, clients = fractions.shape
    if 2 < clients and classes < 2 * clients:  # pairs of classes cost less than rounding every class and client
        _pair_rows(counts, fractions, rng)
    elif 2 < classes:  # many classes for few clients: pairs of clients, trading within the classes
        _pair_rows(counts.T, fractions.T, rng)
    _settle(counts, fractions, rng)
    assert (counts.sum(axis=1) == totals).all() and (counts >= 0).all()
    return counts


def _scaled(proportions: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Each row's shares in units of 1/SCALE example, as exact integers that sum to its total."""
    cumulative = np.cumsum(proportions, axis=1)
    whole = cumulative[:, -1:].copy()
    whole[whole <= 0] = 1.0  # an empty row (no examples of that class) has nothing to share
    ends = np.floor(cumulative / whole * (totals[:, None] * SCALE)).astype(np.int64)
    ends[:, -1] = totals * SCALE  # the last cut is the whole class, exactly
    return np.diff(ends, axis=1, prepend=0)


def _carry(counts: np.ndarray, fractions: np.ndarray, rows: tuple[int, ...], columns: np.ndarray) -> None:
    """Move fractions of ``rows`` that reached a whole example into ``counts`` (only ``columns``, distinct, moved)."""
    for r in rows:
        whole = columns[fractions[r, columns] >= SCALE]
        counts[r, whole] += 1
        fractions[r, whole] -= SCALE


def _pair_rows(counts: np.ndarray, fractions: np.ndarray, rng: np.random.Generator) -> None:
    """Trade fractions between each pair of rows within the columns where both are fractional (one row's entry up,
    the other's down, so neither a row's nor a column's sum moves) until at most one such column is left a pair."""
    rows = len(fractions)
    for i in range(rows):
        for j in range(i + 1, rows):
            both = np.flatnonzero((fractions[i] > 0) & (fractions[j] > 0))
            if len(both) < 2:
                continue
            fi, fj = fractions[i, both], fractions[j, both]
            shift = _pipage(np.maximum(-fi, fj - SCALE), np.minimum(SCALE - fi, fj), rng)
            fractions[i, both] = fi + shift
            fractions[j, both] = fj - shift
            _carry(counts, fractions, (i, j), both)


def _pipage(low: np.ndarray, high: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Shifts, one a column, that sum to zero and each reach ``low`` or ``high`` (all but at most one): two columns
    move against each other until one of them is at a bound, up or down at random in inverse proportion to the room,
    so each shift's expectation stays zero (pipage rounding, Ageev and Sviridenko 2004). Many columns go in disjoint
    pairs at once (each sweep settles at least half of those it pairs), the last few one after another."""
    shift = np.zeros_like(low)
    live = rng.permutation(len(low))
    while len(live) > _FEW:
        half = len(live) // 2
        a, b = live[:half], live[half:2 * half]
        shift_a, shift_b = shift[a], shift[b]
        up = np.minimum(high[a] - shift_a, shift_b - low[b])
        down = np.minimum(shift_a - low[a], high[b] - shift_b)
        step = np.where(rng.integers(0, up + down) < down, up, -down)  # E[step] = 0
        shift[a] = shift_a + step
        shift[b] = shift_b - step
        moved = shift[live]
        live = live[(low[live] < moved) & (moved < high[live])]
    if len(live) >= 2:
        _pipage_in_turn(shift, low, high, live.tolist(), rng.random(len(live)).tolist())
    return shift


_FEW = 24  # below this many open columns a Python loop costs less than a sweep of numpy calls


def _pipage_in_turn(shift: np.ndarray, low: np.ndarray, high: np.ndarray, live: list[int], draws: list[float]) -> None:
    """Pipage over ``live`` one pair at a time: the column left open by each step meets the next one."""
    values = {k: (int(shift[k]), int(low[k]), int(high[k])) for k in live}
    open_one = live[0]
    for k, draw in zip(live[1:], draws):
        sa, la, ha = values[open_one]
        sb, lb, hb = values[k]
        up, down = min(ha - sa, sb - lb), min(sa - la, hb - sb)
        step = up if draw * (up + down) < down else -down  # E[step] = 0
        values[open_one] = (sa + step, la, ha)
        values[k] = (sb - step, lb, hb)
        open_one = k if lb < sb - step < hb else open_one
    for k, (value, _, _) in values.items():
        shift[k] = value


def _settle(counts: np.ndarray, fractions: np.ndarray, rng: np.random.Generator) -> None:
    """Round the fractions left: the clients where two or more rows are fractional by dependent rounding, each row's
    other fractional clients (its own alone) as one edge of the row's whole remainder, dealt out after."""
    fractional = fractions > 0
    alone = fractional & (fractional.sum(axis=0) == 1)
    edges: dict[tuple[int, int], int] = {}  # (row, node) -> value; node k >= 0 a client, -1 - r row r's alone ones
    for r, k in zip(*np.nonzero(fractional & ~alone)):
        edges[int(r), int(k)] = int(fractions[r, k])
    remainders = [int(fractions[r, alone[r]].sum()) for r in range(len(fractions))]
    for r, value in enumerate(remainders):
        if value % SCALE:
            edges[r, -1 - r] = value
    _dependent_rounding(edges, rng)
    for (r, k), value in edges.items():
        if k >= 0:
            counts[r, k] += value // SCALE
        else:
            remainders[r] = value
    for r, value in enumerate(remainders):
        _deal(counts[r], fractions[r], np.flatnonzero(alone[r]), value // SCALE, rng)


def _deal(counts: np.ndarray, fractions: np.ndarray, clients: np.ndarray, ups: int, rng: np.random.Generator) -> None:
    """Round up ``ups`` of ``clients`` (whose fractions sum within one example of ``ups``), systematically from a
    random start: a client with a larger fraction is the likelier."""
    if not len(clients):
        return
    ends = np.cumsum(fractions[clients])
    total = int(ends[-1])
    start = int(rng.integers(max(0, ups * SCALE - total), min(SCALE, (ups + 1) * SCALE - total)))
    passed = (ends + start) // SCALE
    up = np.diff(passed, prepend=start // SCALE) > 0
    assert int(up.sum()) == ups
    counts[clients[up]] += 1


def _dependent_rounding(edges: dict[tuple[int, int], int], rng: np.random.Generator) -> None:
    """Round every value of ``edges`` (a bipartite graph's: rows, nodes) to a whole multiple of SCALE, keeping each
    row's sum and each node's sum, where it had two or more fractional edges, and moving any other node's sum to
    its floor or ceiling; an edge rounds up with the chance of its fraction."""
    live = {e for e, value in edges.items() if value % SCALE}
    around: dict[tuple[str, int], set[tuple[int, int]]] = {}
    for r, k in live:
        around.setdefault(("row", r), set()).add((r, k))
        around.setdefault(("node", k), set()).add((r, k))
    while live:
        walk = _cycle_or_path(next(iter(live)), around)
        signs = [1 - 2 * (n % 2) for n in range(len(walk))]  # +, -, +, ... along it
        rooms_up = [_room(edges[e], s) for e, s in zip(walk, signs)]
        rooms_down = [_room(edges[e], -s) for e, s in zip(walk, signs)]
        up, down = min(rooms_up), min(rooms_down)
        step = up if rng.integers(up + down) < down else -down  # E[step] = 0: each edge keeps its expectation
        for e, s in zip(walk, signs):
            edges[e] += s * step
            if not edges[e] % SCALE:
                live.discard(e)
                around[("row", e[0])].discard(e)
                around[("node", e[1])].discard(e)


def _room(value: int, sign: int) -> int:
    """How far ``value`` may move in direction ``sign`` before it is a whole multiple of SCALE."""
    below = value % SCALE
    return SCALE - below if sign > 0 else below


def _cycle_or_path(first: tuple[int, int],
                   around: dict[tuple[str, int], set[tuple[int, int]]]) -> list[tuple[int, int]]:
    """Fractional edges, ``first`` among them, that form a cycle, or a path whose two ends are nodes with no other
    fractional edge (a row never has exactly one: its fractions sum to whole examples)."""
    ends = [("row", first[0]), ("node", first[1])]
    walk = [first]
    for _ in range(2):  # forward from one end until a vertex repeats (a cycle) or the walk is stuck, then the other
        seen = {v: n for n, v in enumerate(ends)}
        while True:
            here = ends[-1]
            onward = next((e for e in around[here] if e != walk[-1]), None)
            if onward is None:
                break
            there = ("node", onward[1]) if here[0] == "row" else ("row", onward[0])
            if there in seen:
                return walk[seen[there]:] + [onward]
            seen[there] = len(ends)
            ends.append(there)
            walk.append(onward)
        ends.reverse()
        walk.reverse()
    return walk
