"""Who may take an agent's session at the coordinator: a second process joining under a live agent's id is refused
ALREADY_EXISTS (nothing of the first changes), whether the first is long-polling or training (heartbeating); the
agent itself, presenting the session it held, takes a new one; an agent that left, whose long-poll was cut (its
process ended), or who went quiet may be replaced by a fresh process. Real coordinator, raw gRPC over loopback."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import CoordinatorStub
from support.population_calls import refused

SHAPE = (8,)


def _join(stub, agent_id: str = "alice", replaces_token: str = "") -> pb.JoinReply:
    """A Join of ``agent_id``, presenting ``replaces_token`` as the session it held."""
    return stub.Join(pb.JoinRequest(agent_id=agent_id, num_examples=10, replaces_token=replaces_token), timeout=10)


def test_a_second_process_is_refused_while_the_agent_is_live_and_the_agent_itself_may_join_again(start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], min_available=50, heartbeat_seconds=0.5,
                               liveness_timeout_seconds=1.5)
    registry = server.coordinator.registry
    with grpc.insecure_channel(server.address) as channel:
        stub = CoordinatorStub(channel)
        first = _join(stub)
        held = registry.get("alice")
        refused(lambda: _join(stub), grpc.StatusCode.ALREADY_EXISTS,
                "agent 'alice' is already connected from 127.0.0.1:")
        refused(lambda: _join(stub, replaces_token="not-its-session"), grpc.StatusCode.ALREADY_EXISTS, "heard from")
        refused(lambda: _join(stub, replaces_token="x" * 257), grpc.StatusCode.INVALID_ARGUMENT,
                "replaces_token has 257")
        for _ in range(4):  # training: its heartbeats keep it live past the liveness timeout
            stub.Heartbeat(pb.HeartbeatRequest(auth=pb.AgentAuth(agent_id="alice", token=first.token)), timeout=10)
            time.sleep(0.5)
        refused(lambda: _join(stub), grpc.StatusCode.ALREADY_EXISTS, "already connected")
        assert registry.get("alice") is held and held.token == first.token and registry.live_ids() == ["alice"]

        again = _join(stub, replaces_token=first.token)  # the same process: it proves it with the session it held
        assert again.token != first.token and registry.live_ids() == ["alice"]
        refused(lambda: stub.Heartbeat(pb.HeartbeatRequest(auth=pb.AgentAuth(agent_id="alice", token=first.token)),
                                       timeout=10), grpc.StatusCode.UNAUTHENTICATED, "call Join again")


def test_a_long_polling_agent_is_live(start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], min_available=50, heartbeat_seconds=0.5,
                               liveness_timeout_seconds=1.5)
    with grpc.insecure_channel(server.address) as channel:
        stub = CoordinatorStub(channel)
        auth = pb.AgentAuth(agent_id="alice", token=_join(stub).token)
        end = time.monotonic() + 2.5  # past the liveness timeout: the long-polls (each capped at the heartbeat) keep
        while time.monotonic() < end:  # it live
            assert stub.PullTask(pb.PullTaskRequest(auth=auth, wait_seconds=5.0), timeout=10).wait_seconds == 0
        refused(lambda: _join(stub), grpc.StatusCode.ALREADY_EXISTS, "already connected")


def test_a_fresh_process_takes_the_place_of_an_agent_whose_long_poll_was_cut(start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], min_available=50, heartbeat_seconds=5.0,
                               liveness_timeout_seconds=60.0)  # it does not lapse in this test
    registry = server.coordinator.registry
    with grpc.insecure_channel(server.address) as dying:  # its process dies in the middle of a long-poll
        stub = CoordinatorStub(dying)
        first = _join(stub)
        call = stub.PullTask.future(pb.PullTaskRequest(auth=pb.AgentAuth(agent_id="alice", token=first.token),
                                                       wait_seconds=5.0), timeout=10)
        time.sleep(0.3)
        refused(lambda: _join(stub), grpc.StatusCode.ALREADY_EXISTS, "already connected")  # polling: live
        call.cancel()
    with grpc.insecure_channel(server.address) as channel:
        stub = CoordinatorStub(channel)
        end = time.monotonic() + 10
        while True:  # the coordinator hears of the cut at once
            try:
                second = _join(stub)
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.ALREADY_EXISTS and time.monotonic() < end, err.details()
                time.sleep(0.05)
        assert second.token != first.token and registry.get("alice").token == second.token
        refused(lambda: _join(stub), grpc.StatusCode.ALREADY_EXISTS, "already connected")  # the new one is live


def test_an_agent_that_left_or_went_quiet_may_be_replaced_by_a_fresh_process(start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], min_available=50, heartbeat_seconds=0.5,
                               liveness_timeout_seconds=1.0)
    with grpc.insecure_channel(server.address) as channel:
        stub = CoordinatorStub(channel)
        first = _join(stub)
        stub.Leave(pb.LeaveRequest(auth=pb.AgentAuth(agent_id="alice", token=first.token)), timeout=10)
        second = _join(stub)  # it said goodbye: its process is gone
        refused(lambda: _join(stub), grpc.StatusCode.ALREADY_EXISTS, "already connected")
        time.sleep(1.3)  # the liveness timeout passes without a call
        third = _join(stub)
        assert third.token not in (first.token, second.token)
        assert server.coordinator.registry.live_ids() == ["alice"]


def test_a_join_sent_again_after_its_reply_was_lost_is_the_same_process_s(start_coordinator):
    """The process drew an incarnation and sends it with every Join: its first Join's reply lost (no session to
    present yet), the Join it sends again takes a session; another process's incarnation is refused."""
    server = start_coordinator([np.zeros(SHAPE, np.float32)], min_available=50, heartbeat_seconds=0.5,
                               liveness_timeout_seconds=5.0)
    with grpc.insecure_channel(server.address) as channel:
        stub = CoordinatorStub(channel)

        def join(incarnation: str) -> pb.JoinReply:
            return stub.Join(pb.JoinRequest(agent_id="alice", num_examples=10, incarnation=incarnation), timeout=10)

        lost = join("process-a")  # registered; its reply never reached the agent
        again = join("process-a")
        assert again.token != lost.token and server.coordinator.registry.get("alice").token == again.token
        refused(lambda: join("process-b"), grpc.StatusCode.ALREADY_EXISTS, "agent 'alice' is already connected")
        refused(lambda: join(""), grpc.StatusCode.ALREADY_EXISTS, "agent 'alice' is already connected")
        refused(lambda: join("x" * 257), grpc.StatusCode.INVALID_ARGUMENT, "incarnation has 257")


def test_an_agent_started_again_after_its_process_was_killed_waits_for_its_place_and_a_live_holder_keeps_it(
        start_coordinator, caplog):
    """A process killed while training (heartbeating: no long-poll whose cut the coordinator hears) holds its place
    for the liveness timeout; the agent started again at once is told when it frees, waits, and joins (a service
    manager restarting it would otherwise see it exit, and give up). A holder heard from meanwhile is alive: the
    second process is refused after one wait. The client's own joining code (client/links.Reconnecting)."""
    import random

    from fedpar.client.links import IdTaken, Reconnecting

    server = start_coordinator([np.zeros(SHAPE, np.float32)], min_available=50, heartbeat_seconds=0.3,
                               liveness_timeout_seconds=1.5)
    registry = server.coordinator.registry
    with grpc.insecure_channel(server.address) as channel:
        stub = CoordinatorStub(channel)
        killed = _join(stub)
        stub.Heartbeat(pb.HeartbeatRequest(auth=pb.AgentAuth(agent_id="alice", token=killed.token)), timeout=10)
        joined: list[pb.JoinReply] = []
        restarted = Reconnecting("alice", server.address, lambda: joined.append(_join(stub)), first=0.01, cap=0.05,
                                 rng=random.Random(0))
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="fedpar.client"):
            restarted.join()
        assert 1.0 < time.monotonic() - started < 5.0  # the rest of the liveness timeout, and a little
        assert "waiting for that place" in caplog.text and "already connected" in caplog.text
        assert registry.get("alice").token == joined[0].token != killed.token

        live = joined[0].token
        beating = threading.Event()

        def heartbeats() -> None:
            while not beating.wait(0.2):
                stub.Heartbeat(pb.HeartbeatRequest(auth=pb.AgentAuth(agent_id="alice", token=live)), timeout=10)
        beat = threading.Thread(target=heartbeats)
        beat.start()
        try:
            second = Reconnecting("alice", server.address, lambda: _join(stub), first=0.01, cap=0.05,
                                  rng=random.Random(0))
            with pytest.raises(IdTaken, match="already connected"):
                second.join()
        finally:
            beating.set()
            beat.join(10)
        assert registry.get("alice").token == live  # nothing of the live one changed
