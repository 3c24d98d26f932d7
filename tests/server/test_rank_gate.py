"""A replacement aggregator rank listens on the lost rank's port before rank 0 takes it back: the agents that call it
meanwhile are told to retry (UNAVAILABLE), not that they are unknown; once in the group it checks sessions as any
registry does."""

from __future__ import annotations

import grpc
import pytest

from fedpar.server.ranks.gate import RankRegistry
from fedpar.server.registry import AuthError
from fedpar.server.rounds import Refusal


def test_a_rank_not_in_the_group_answers_unavailable_then_checks_sessions_once_taken_back():
    sessions = RankRegistry(float("inf"))
    sessions.rank, sessions.admitting = 1, False
    sessions.admit_session("a1", "token", 10, None)
    for call in (lambda: sessions.authenticate("a1", "token"), lambda: sessions.authenticate("a9", "x"),
                 lambda: sessions.authenticate_host("h0", "x")):
        with pytest.raises(Refusal) as refused:
            call()
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert "aggregator rank 1 is starting again" in refused.value.message
    sessions.admitting = True  # taken back, with the model
    assert sessions.authenticate("a1", "token").agent_id == "a1"
    with pytest.raises(AuthError, match="unknown agent"):
        sessions.authenticate("a9", "x")
