"""Grouped folds: accepted updates join the round's sum in groups when they arrive faster than it folds them.

A running sum reads and writes its accumulator once per pass; an update that becomes ready while a fold runs
waits here, and the next fold takes every waiting update (up to the strategy's group size) in one pass
(``Strategy.fold_many``), so the accumulator's memory traffic is paid once per group. Updates fold in the order
they were accepted, as one-by-one folds would (bit for bit the same sum). A waiting update is the staged upload's
own arrays (no copy; the upload keeps its staging slot until its fold is done), so grouping adds no memory.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque

from fedpar.aggregation.strategy import FoldItem
from fedpar.server.rounds import RoundState, RunUpdate


class FoldQueue:
    """One fold at a time into ``strategy``, each taking every update that waits for it (loop only)."""

    def __init__(self, strategy, run_update: RunUpdate, known_finite: bool):
        self.strategy = strategy
        self.fold_many = functools.partial(strategy.fold_many, known_finite=known_finite)
        self.run_update = run_update  # on the loop for small updates, on a worker thread for large ones
        self._waiting: deque[tuple[RoundState, FoldItem, asyncio.Future]] = deque()
        self._draining = False

    async def fold(self, state: RoundState, item: FoldItem) -> None:
        """Fold ``item`` into the strategy (with the others waiting); a ValueError if the strategy refused it (its
        state then unchanged by it: the rest of its group still counts)."""
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((state, item, done))
        if not self._draining:
            self._draining = True
            asyncio.ensure_future(self._drain())
        await done

    async def _drain(self) -> None:
        """Fold groups until none waits: each takes up to the strategy's group size, oldest first."""
        try:
            while self._waiting:
                group = [self._waiting.popleft() for _ in range(min(len(self._waiting), self.strategy.group_size))]
                started = time.perf_counter()
                try:
                    refused = await self.run_update(self.fold_many, [item for _, item, _ in group])
                except Exception as exc:  # not a refusal: the fold itself failed (the caller fails the round)
                    refused = [exc] * len(group)
                seconds = time.perf_counter() - started
                for state in {id(s): s for s, _, _ in group}.values():  # one round's, as a round closes after its folds
                    state.fold_seconds += seconds
                    state.fold_groups += 1
                    state.fold_group_max = max(state.fold_group_max, len(group))
                for (_, _, done), error in zip(group, refused):
                    if done.cancelled():
                        continue
                    if error is None:
                        done.set_result(None)
                    else:
                        done.set_exception(error)
        finally:
            self._draining = False
