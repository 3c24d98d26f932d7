"""A coordinator restarted from its checkpoint continues a stateful strategy (Adam moments, server momentum)
exactly: 2 rounds, restart, round 3 gives the same model, bit for bit, as 3 uninterrupted rounds."""

from __future__ import annotations

import numpy as np
import pytest

from fedpar.aggregation import build_strategy
from fedpar.protocol.codec import ModelLayout

SHAPES = ((20, 30), (30,), (30, 5))
NAMES = [f"t{i}" for i in range(len(SHAPES))]
OPTIONS = {"fedadam": {"eta": 0.05, "bias_correction": True}, "fedavgm": {"server_momentum": 0.8}}


def _init():
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def _play(server, agents, rounds, agent_id):
    """One agent trains every round: new weights = downloaded global + a fixed per-round step."""
    (agent,) = agents(server.address, [agent_id])
    layout = ModelLayout.of_arrays(NAMES, _init())
    starts = []
    for r in rounds:
        task = agent.task()
        assert task.round == r
        start = agent.download(task, layout)
        starts.append(start)
        step = np.random.default_rng(100 + r)
        update = [(w + 0.1 * step.standard_normal(w.shape)).astype(np.float32) for w in start]
        assert agent.upload(task, update, 10 + r).accepted
    assert server.wait(30)
    return starts


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_a_restarted_coordinator_continues_the_strategy_state_exactly(name, start_coordinator, agents, tmp_path):
    config = dict(clients_per_round=1, min_available=1)
    straight = start_coordinator(_init(), strategy=build_strategy(name, **OPTIONS[name]), rounds=3, **config)
    straight_starts = _play(straight, agents, [1, 2, 3], "a")

    ckpt = tmp_path / "ckpt"
    first = start_coordinator(_init(), strategy=build_strategy(name, **OPTIONS[name]), rounds=2,
                              checkpoint_dir=ckpt, **config)
    _play(first, agents, [1, 2], "a")
    first.stop()
    resumed = start_coordinator(_init(), strategy=build_strategy(name, **OPTIONS[name]), rounds=3,
                                checkpoint_dir=ckpt, **config)
    assert resumed.coordinator.round_id == 2
    before_round_3 = [w.copy() for w in resumed.coordinator.weights]
    (resumed_start,) = _play(resumed, agents, [3], "a")

    assert [w.tobytes() for w in resumed_start] == [w.tobytes() for w in straight_starts[2]]
    final, expected = resumed.coordinator.weights, straight.coordinator.weights
    assert [w.tobytes() for w in final] == [w.tobytes() for w in expected]
    arrays, meta = resumed.coordinator.strategy.state_dict()
    want_arrays, want_meta = straight.coordinator.strategy.state_dict()
    assert meta == want_meta and sorted(arrays) == sorted(want_arrays)
    assert all(arrays[k].tobytes() == want_arrays[k].tobytes() for k in arrays)

    # Round 3 from a fresh strategy (no restored moments) would have given another model.
    fresh = build_strategy(name, **OPTIONS[name])
    fresh.begin_round(3, before_round_3)
    step = np.random.default_rng(103)
    fresh.fold([(w + 0.1 * step.standard_normal(w.shape)).astype(np.float32) for w in before_round_3], 13, "a")
    forgetful, _ = fresh.finish()
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(forgetful, final)) > 1e-3
