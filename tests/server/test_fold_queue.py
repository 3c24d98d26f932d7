"""The coordinator's folds (server/round_modes.py FoldQueue, through the round mode's accept): updates accepted while a fold
runs wait and join the next fold as one group; the sum is bit for bit the one-by-one folds in acceptance order;
an update the strategy refuses inside a group is refused alone."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from fedpar.aggregation import FedAvg
from fedpar.protocol.compressed_wire import CompressionConfig
from fedpar.protocol.codec import SMALL_UPDATE_BYTES
from fedpar.server.config import CoordinatorConfig
from fedpar.server.round_modes import RoundModes
from fedpar.server.rounds import STAT_NAMES, AgentSlot, Refusal, RoundState, UploadTicket, ingest_stats

NAMES = ["w", "b"]
GLOBAL = [np.zeros(SMALL_UPDATE_BYTES // 4 + 1000, np.float32), np.zeros(3, np.float32)]  # folded on a worker thread


def _update(j: int) -> list[np.ndarray]:
    rng = np.random.default_rng(j)
    return [rng.standard_normal(a.shape).astype(np.float32) for a in GLOBAL]


def _accept_together(config: CoordinatorConfig, updates: list[list[np.ndarray]], executor):
    """Accept every update at once (as uploads whose bytes all arrived while a fold ran); the round's state, the
    strategy and each accept's outcome (None or the Refusal)."""
    strategy = FedAvg()
    mode = RoundModes(config, NAMES, GLOBAL, strategy, executor).run_mode
    slots = {f"a{j}": AgentSlot(f"a{j}", f"t{j}") for j in range(len(updates))}
    state = RoundState(1, len(updates), 1, 30.0, slots)
    strategy.begin_round(1, GLOBAL)

    async def run():
        tickets = [UploadTicket(state, slots[f"a{j}"], 10 + j, {}, mode.layout, mode) for j in range(len(updates))]
        return await asyncio.gather(*(mode.accept(state, t, u) for t, u in zip(tickets, updates)),
                                    return_exceptions=True)
    return state, strategy, asyncio.run(run())


def _one_by_one(updates, skip=()) -> list[bytes]:
    strategy = FedAvg()
    strategy.begin_round(1, GLOBAL)
    for j, u in enumerate(updates):
        if j not in skip:
            strategy.fold(u, 10 + j, f"a{j}", known_finite=True)
    return [a.tobytes() for a in strategy.finish()[0]]


def test_updates_that_wait_for_a_fold_are_folded_in_groups_in_the_order_they_were_accepted():
    updates = [_update(j) for j in range(12)]
    with ThreadPoolExecutor(2) as executor:
        state, strategy, outcomes = _accept_together(CoordinatorConfig(), updates, executor)
    assert outcomes == [None] * 12 and state.accepted == 12
    # the first fold takes the 8 waiting (the strategy's group size: one pass over its sum), the next the other 4
    assert (state.fold_groups, state.fold_group_max) == (2, 8) and state.fold_seconds > 0
    stats = dict(zip(STAT_NAMES, ingest_stats(state, 0)))
    assert (stats["uploads"], stats["fold_groups"], stats["fold_group_max"]) == (12, 2, 8)
    assert [a.tobytes() for a in strategy.finish()[0]] == _one_by_one(updates)


def test_an_update_refused_by_the_strategy_inside_a_group_is_refused_alone():
    # Compressed rounds fold global + the decoded delta, which the strategy checks for NaN/Inf itself.
    config = CoordinatorConfig(upload_compression=CompressionConfig(method="fp16"))
    updates = [_update(j) for j in range(4)]
    updates[2][0][5] = np.inf
    with ThreadPoolExecutor(2) as executor:
        state, strategy, outcomes = _accept_together(config, updates, executor)
    assert [o is None for o in outcomes] == [True, True, False, True]
    refusal = outcomes[2]
    assert isinstance(refusal, Refusal) and refusal.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "NaN or Inf" in refusal.message
    assert (state.accepted, state.rejected, state.slots["a2"].status) == (3, 1, "rejected")
    assert (state.fold_groups, state.fold_group_max) == (1, 4)
    assert [a.tobytes() for a in strategy.finish()[0]] == _one_by_one(updates, skip={2})


def test_a_lone_update_folds_at_once_alone():
    with ThreadPoolExecutor(2) as executor:
        state, _, outcomes = _accept_together(CoordinatorConfig(), [_update(0)], executor)
    assert outcomes == [None] and (state.fold_groups, state.fold_group_max) == (1, 1)
