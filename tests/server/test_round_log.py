"""The coordinator's round log line (server/coordinator.py): what moved a round's K from the settings is said once,
not on every round (a 1000-round run with 2 agents and the default --clients-per-round 10 said it 1000 times)."""

from __future__ import annotations

import logging

from support.abuse import run_under_attack
from support.attacks import coordinator_server


def test_a_target_moved_the_same_way_each_round_is_said_once(caplog):
    server = coordinator_server(rounds=4, clients_per_round=10, min_available=2)
    with caplog.at_level(logging.INFO, logger="fedpar.server"):
        run = run_under_attack(server, None, n_agents=2, before=1, during=2, train_seconds=0.02)
    assert [r["status"] for r in run.rows] == ["ok"] * 4, run.rows
    sampled = [r.getMessage() for r in caplog.records if ": sampled 2 of 2 live agents, target 2" in r.getMessage()]
    assert len(sampled) == 4, sampled
    moved = [line for line in sampled if "(--clients-per-round 10 is above the 2 agents sampled; using 2)" in line]
    assert moved == [sampled[0]], sampled
