"""The registry holds live agents only: ids that went silent past --liveness-timeout leave it (what a returning one
needs, its first example count, stays in a bounded map and in the checkpoint), and a restarted coordinator starts
its first round once --min-available agents are back, not after waiting for every id it ever knew.
Real coordinators over loopback gRPC."""

from __future__ import annotations

import time

import numpy as np

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.server.config import CoordinatorConfig
from fedpar.server.limits import Limits
from fedpar.server.registry import AgentRegistry
from support.scripted_agent import ScriptedAgent

CHURNED = 200


def _weights() -> list[np.ndarray]:
    return [np.zeros((4, 3), np.float32), np.zeros(3, np.float32)]


def _heartbeat(agents: list[ScriptedAgent]) -> None:
    for agent in agents:
        agent.stub.Heartbeat(pb.HeartbeatRequest(auth=agent.auth), timeout=10)


def test_churned_agents_leave_the_registry_and_only_the_live_ones_stay(start_coordinator):
    server = start_coordinator(_weights(), min_available=CHURNED + 10, liveness_timeout_seconds=1.5,
                               heartbeat_seconds=0.5, max_agents=CHURNED + 10)
    coordinator = server.coordinator
    live = [ScriptedAgent(server.address, f"live-{i}") for i in range(2)]
    try:
        for i in range(CHURNED):  # distinct ids that join once and go silent
            ScriptedAgent(server.address, f"gone-{i:03d}", num_examples=10 + i).close()
        assert server.on_loop(lambda: len(coordinator.registry)) == CHURNED + 2
        registry = coordinator.registry
        end = time.monotonic() + 60  # until the silent ones are past the liveness timeout; the live ones keep calling
        while time.monotonic() < end and server.on_loop(lambda: len(registry)) > 2:
            _heartbeat(live)
            time.sleep(0.3)
        assert server.on_loop(registry.live_ids) == ["live-0", "live-1"]
        assert server.on_loop(lambda: (len(registry), registry.host_count)) == (2, 0)
        # What a returning agent needs stays: the count it declared first caps it (one small int per id).
        back = ScriptedAgent(server.address, "gone-005", num_examples=5000)
        live.append(back)
        assert server.on_loop(lambda: registry.get("gone-005").num_examples) == 15
        assert server.on_loop(lambda: len(registry.caps)) == CHURNED + 2
        # Nor does the coordinator keep a long-poll wake-up per agent it forgot.
        assert server.on_loop(lambda: coordinator.members.wakeups_held) <= 2 * 3 + 64
    finally:
        for agent in live:
            agent.close()


def test_the_example_caps_are_bounded_by_max_agents(start_coordinator):
    server = start_coordinator(_weights(), min_available=20, liveness_timeout_seconds=0.5, heartbeat_seconds=0.25,
                               max_agents=20)
    for i in range(60):  # three registries' worth of ids, each silent at once: joins never run out of room
        ScriptedAgent(server.address, f"a{i:02d}", num_examples=7).close()
        if i % 19 == 18:
            time.sleep(0.6)  # past the liveness timeout
    registry = server.coordinator.registry
    assert server.on_loop(lambda: len(registry.caps)) == 20
    assert list(server.on_loop(registry.snapshot)) == [f"a{i:02d}" for i in range(40, 60)]  # the newest


def test_a_restarted_coordinator_starts_once_min_available_agents_are_back(start_coordinator, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = start_coordinator(_weights(), rounds=1, min_available=50, clients_per_round=1, checkpoint_dir=ckpt,
                              liveness_timeout_seconds=20.0, heartbeat_seconds=1.0)
    agents = [ScriptedAgent(first.address, f"ag{i:02d}", num_examples=40) for i in range(50)]
    try:
        end = time.monotonic() + 20
        while first.on_loop(lambda: first.coordinator.current) is None and time.monotonic() < end:
            time.sleep(0.05)
        (sampled,) = first.on_loop(lambda: list(first.coordinator.current.slots))
        holder = next(a for a in agents if a.agent_id == sampled)
        assert holder.upload(holder.task(), [w + 1 for w in _weights()], 40).accepted
        assert first.wait(30)
    finally:
        for agent in agents:
            agent.close()
    first.stop()

    second = start_coordinator(_weights(), rounds=2, min_available=1, clients_per_round=1, checkpoint_dir=ckpt,
                               liveness_timeout_seconds=20.0, heartbeat_seconds=1.0)
    assert second.coordinator.round_id == 1
    started = time.monotonic()
    back = ScriptedAgent(second.address, "ag07", num_examples=4000)  # one of the fifty; the 49 others stay away
    try:
        task = back.task(timeout=15)
        waited = time.monotonic() - started
        assert task.round == 2 and waited < 5.0, waited  # not the 20 s liveness timeout for the 49 others
        assert second.on_loop(lambda: second.coordinator.registry.get("ag07").num_examples) == 40
        assert back.upload(task, [w + 2 for w in _weights()], 40).accepted
        assert second.wait(30)
    finally:
        back.close()


def test_per_agent_limits_forget_agents_that_are_done():
    """Upload attempts live for their round and byte-rate buckets until they refill: 500 uploaders of one round
    leave one entry per uploader of the next round, and refilled buckets are swept as new agents come."""
    now = [0.0]
    config = CoordinatorConfig(max_upload_bytes_per_second=1000.0)
    limits = Limits(config, model_bytes=100, clock=lambda: now[0])
    for i in range(500):
        limits.start_upload(f"a{i}", 1)
        limits.count_bytes(f"a{i}", 100)
    limits.start_upload("a0", 2)
    assert len(limits._attempts) == 1  # peeked at: the bound is the point, there is no public view
    now[0] += 10.0  # every bucket refilled: as good as none, so a sweep drops them (when the map has doubled)
    for i in range(500):
        limits.count_bytes(f"b{i}", 100)
    assert len(limits._bytes) <= 500 and not any(agent.startswith("a") for agent in limits._bytes)


def test_an_aggregator_ranks_taken_sessions_go_idle_by_themselves_while_their_host_stays():
    now = [0.0]
    registry = AgentRegistry(float("inf"), clock=lambda: now[0])
    for round_id in range(1, 51):  # each round rank 0 deals this rank 10 other members of one live host
        registry.expire(5.0)
        registry.admit_host_session("host-0", "tok", None)
        for i in range(10):
            registry.admit_session(f"m{round_id}-{i}", f"t{i}", 10, None, "host-0")
        now[0] += 1.0
    assert len(registry) <= 60, len(registry)  # the last 5-6 rounds' members, not all 500
    assert registry.authenticate_host("host-0", "tok").host_id == "host-0"
    assert registry.authenticate("m50-3", "t3").host == "host-0"
    now[0] += 10.0
    registry.expire(5.0)
    assert len(registry) == 0 and registry.host("host-0") is None
