"""A round looks its cohort's records up together (AgentRegistry.get_many: one pass over the member table): each
record is the one a lookup of that id alone gives, in the order asked, None where there is none."""

from __future__ import annotations

import pytest

from fedpar.protocol.codec import member_token
from fedpar.server.registry import AgentRegistry


def test_records_looked_up_together_are_those_looked_up_one_by_one():
    registry = AgentRegistry(liveness_timeout=60.0)
    registry.join("agent-1", 7, {})
    first = registry.join_population("host-a", "", "m-03\nm-01", [3, 1], away=[0])
    registry.join_population("host-a", first.token, "m-02", [2])  # a later join: a run of its own
    registry.join_population("host-b", "", "n-01", [9])
    asked = ["n-01", "nobody", "m-03", "agent-1", "m-01\0", "m-02", "m-01", "m-02"]
    records = registry.get_many(asked)
    assert records == [registry.get(a) for a in asked]
    assert [r and (r.agent_id, r.num_examples, r.host, r.away) for r in records] == [
        ("n-01", 9, "host-b", False), None, ("m-03", 3, "host-a", True), ("agent-1", 7, None, False), None,
        ("m-02", 2, "host-a", False), ("m-01", 1, "host-a", False), ("m-02", 2, "host-a", False)]
    assert records[2].token == member_token(first.token, "m-03")
    assert registry.get_many([]) == []


def test_a_partials_members_are_looked_up_by_host_and_examples_without_deriving_their_tokens(monkeypatch):
    from fedpar.server import registry as registry_module

    registry = AgentRegistry(liveness_timeout=60.0)
    registry.join("agent-1", 7, {})
    registry.join_population("host-a", "", "m-03\nm-01", [3, 1], away=[0])
    registry.join_population("host-b", "", "n-01", [9])
    asked = ["n-01", "nobody", "m-03", "agent-1", "m-01\0", "m-01"]
    want = [(r.host, r.num_examples) if r else (None, 0) for r in registry.get_many(asked)]
    monkeypatch.setattr(registry_module, "_member_token", lambda *a: pytest.fail("a session token was derived"))
    assert registry.member_hosts(asked) == want == [("host-b", 9), (None, 0), ("host-a", 3), (None, 7),
                                                     (None, 0), ("host-a", 1)]
    registry.leave("agent-1")
    assert registry.member_hosts(["agent-1"]) == [(None, 0)] and registry.member_hosts([]) == []
