"""Who may take a simulation host's session at the coordinator: a second process under a live host's id is refused
ALREADY_EXISTS (nothing of the first changes); the host itself, presenting the session it held, takes a new one (its
old long-poll ends at once, leaving the tasks to the new session); a host whose task stream ended or who went quiet
may be replaced by a fresh process. Real coordinator, raw gRPC over loopback."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from fedpar.protocol import fedpar_pb2 as pb
from support.population_calls import host_stub, join_members, pull_tasks, refused

SHAPE = (8,)
MEMBERS = ["m0", "m1", "m2"]


def _rejoin(stub, host: str, replaces_token: str, incarnation: str = "") -> pb.JoinPopulationReply:
    """A new session for ``host``'s members, presenting ``replaces_token`` as the session it held and
    ``incarnation`` as its process's."""
    return stub.JoinPopulation(pb.JoinPopulationRequest(host=pb.AgentAuth(agent_id=host), replaces_token=replaces_token,
                                                        incarnation=incarnation, member_ids="\n".join(MEMBERS),
                                                        num_examples=[10] * 3), timeout=10)


def test_a_second_process_is_refused_while_the_host_is_live_and_the_host_itself_may_join_again(start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, min_available=50)
    stub, registry = host_stub(server), server.coordinator.registry
    first = join_members(stub, "h", MEMBERS)
    held = registry.host("h")
    refused(lambda: join_members(stub, "h", MEMBERS), grpc.StatusCode.ALREADY_EXISTS,
            "host 'h' is already connected from 127.0.0.1:")
    refused(lambda: _rejoin(stub, "h", "not-its-session"), grpc.StatusCode.ALREADY_EXISTS, "already connected")
    refused(lambda: _rejoin(stub, "h", "x" * 257), grpc.StatusCode.INVALID_ARGUMENT, "replaces_token has 257")
    assert registry.host("h") is held and held.token == first.host_token and len(registry.live_ids()) == 3

    again = _rejoin(stub, "h", first.host_token)  # the same process: it proves it with the session it held
    assert again.host_token != first.host_token and len(registry.live_ids()) == 3
    refused(lambda: pull_tasks(stub, pb.PullHostTasksRequest(host=pb.AgentAuth(agent_id="h", token=first.host_token))),
            grpc.StatusCode.UNAUTHENTICATED, "call JoinPopulation again")


def test_the_old_sessions_long_poll_ends_when_the_host_joins_again(start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, min_available=50,
                               heartbeat_seconds=20.0, liveness_timeout_seconds=30.0)
    stub = host_stub(server)
    first = join_members(stub, "h", MEMBERS)
    ended: list[grpc.RpcError] = []

    def long_poll() -> None:
        with pytest.raises(grpc.RpcError) as err:
            pull_tasks(stub, pb.PullHostTasksRequest(host=pb.AgentAuth(agent_id="h", token=first.host_token),
                                                     wait_seconds=20.0), timeout=30)
        ended.append(err.value)

    poll = threading.Thread(target=long_poll)
    poll.start()
    time.sleep(0.5)  # the long-poll waits
    started = time.monotonic()
    _rejoin(stub, "h", first.host_token)
    poll.join(10)
    assert ended and time.monotonic() - started < 5, "the old session's long-poll kept waiting"
    assert ended[0].code() == grpc.StatusCode.UNAUTHENTICATED and "replaced" in ended[0].details()


def test_a_fresh_process_takes_the_place_of_a_host_whose_stream_ended_or_who_went_quiet(start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, min_available=50,
                               heartbeat_seconds=0.5, liveness_timeout_seconds=1.0)
    stub = host_stub(server)
    first = join_members(stub, "h", MEMBERS)
    pull_tasks(stub, pb.PullHostTasksRequest(host=pb.AgentAuth(agent_id="h", token=first.host_token)))
    second = join_members(stub, "h", MEMBERS)  # its task stream ended, and nothing came since: its process is gone
    assert second.host_token != first.host_token
    refused(lambda: join_members(stub, "h", MEMBERS), grpc.StatusCode.ALREADY_EXISTS, "already connected")
    time.sleep(1.3)  # the liveness timeout passes without a call
    third = join_members(stub, "h", MEMBERS)
    assert third.host_token not in (first.host_token, second.host_token)
    assert len(server.coordinator.registry.live_ids()) == 3


def test_a_join_sent_again_after_its_reply_was_lost_is_the_same_host_process_s(start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, min_available=50)
    stub = host_stub(server)
    lost = _rejoin(stub, "h", "", "process-a")  # registered; its reply never reached the host
    again = _rejoin(stub, "h", "", "process-a")
    assert again.host_token != lost.host_token and server.coordinator.registry.host("h").token == again.host_token
    refused(lambda: _rejoin(stub, "h", "", "process-b"), grpc.StatusCode.ALREADY_EXISTS, "already connected")
