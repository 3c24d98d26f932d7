"""A simulation host that says goodbye (Leave with its own session, as its process exits) takes its members with it:
the open round stops waiting for those it sampled and none is sampled again; and a host that declares a population
smaller than one-shot serve's --min-available is said once naming both (it hung in silence; agents joining by
themselves, later too, may make up the rest, so it is not refused), while a slice of a large enough population is not.
Real coordinator, raw gRPC over loopback."""

from __future__ import annotations

import time

import grpc
import numpy as np

from fedpar.protocol import fedpar_pb2 as pb
from support.population_calls import host_stub, join_members, pull_tasks, refused

SHAPE = (8,)


def _one_shot(server) -> None:
    """As one-shot serve sets its coordinator up: hosts declaring another task (or too small a population) refused."""
    server.coordinator.members.refuse_other_tasks("--model mlp --dataset digits", lambda a, b: a == b)


def test_a_host_that_leaves_ends_the_wait_for_its_sampled_members_and_they_are_not_sampled_again(start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, clients_per_round=4,
                               min_available=4, deadline_seconds=60, rounds=2)
    stub = host_stub(server)
    reply = join_members(stub, "host-a", [f"m{i}" for i in range(4)])
    host = pb.AgentAuth(agent_id="host-a", token=reply.host_token)
    got = []
    end = time.monotonic() + 20
    while len(got) < 4 and time.monotonic() < end:
        got += pull_tasks(stub, pb.PullHostTasksRequest(host=host, wait_seconds=1.0)).tasks
    assert len(got) == 4
    refused(lambda: stub.Leave(pb.LeaveRequest(auth=pb.AgentAuth(agent_id="host-a", token="forged")), timeout=10),
            grpc.StatusCode.UNAUTHENTICATED, "")
    assert server.coordinator.registry.host("host-a") is not None  # a forged goodbye is refused, nothing forgotten
    left = time.monotonic()
    stub.Leave(pb.LeaveRequest(auth=host), timeout=10)
    assert server.coordinator.registry.host("host-a") is None and server.coordinator.members.live_ids() == []
    end = time.monotonic() + 10
    while not list(server.coordinator.metrics.read_rows()) and time.monotonic() < end:
        time.sleep(0.1)
    rows = list(server.coordinator.metrics.read_rows())
    assert len(rows) == 1 and rows[0]["reported"] == 0 and time.monotonic() - left < 10, rows  # not the 60 s
    assert server.coordinator.members.live_ids() == []  # none left to sample in the next round
    refused(lambda: pull_tasks(stub, pb.PullHostTasksRequest(host=host, wait_seconds=0.1)),
            grpc.StatusCode.UNAUTHENTICATED, "")


def test_a_population_smaller_than_min_available_is_said_once_naming_both(start_coordinator, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="fedpar.server")
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, min_available=100)
    _one_shot(server)
    stub = host_stub(server)
    token = ""
    for part in range(2):  # a host joins its members in several calls: said once
        token = join_members(stub, "host-0-of-1", [f"m{part}-{i}" for i in range(25)], token=token,
                             capabilities={"population": "50"}).host_token
    said = [r.getMessage() for r in caplog.records if "population of 50 clients" in r.getMessage()]
    assert said == ["simulation host host-0-of-1 hosts a slice of a population of 50 clients (simulate-workers "
                    "--clients 50), and this run waits for 100 (serve --min-available 100): its rounds start only "
                    "once agents or other hosts make up the other 50; start both with the same number if this is "
                    "the whole population"], said
    assert server.coordinator.registry.host("host-0-of-1") is not None  # not refused: agents may come
    refused(lambda: join_members(stub, "host-bad", ["b0"], capabilities={"population": "-5"}),
            grpc.StatusCode.INVALID_ARGUMENT, "capability 'population' must be a count of clients")
    assert server.coordinator.registry.host("host-bad") is None  # checked before it was registered


def test_each_slice_of_a_whole_population_and_a_population_with_agents_beside_it_take_part(start_coordinator, agents):
    """torchrun ranks each host a slice, and each declares the whole population, which is what is compared; agents
    that join by themselves may make up the rest."""
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, min_available=100)
    _one_shot(server)
    stub = host_stub(server)
    for rank in range(2):
        reply = join_members(stub, f"host-{rank}-of-2", [f"r{rank}m{i}" for i in range(50)],
                             capabilities={"population": "100"})
        pull_tasks(stub, pb.PullHostTasksRequest(host=pb.AgentAuth(agent_id=f"host-{rank}-of-2",
                                                                   token=reply.host_token), wait_seconds=0.1))
    assert len(server.coordinator.registry) == 100
    reply = join_members(stub, "older-host", ["o0"])  # a host that declares no population (an older fedpar) joins
    pull_tasks(stub, pb.PullHostTasksRequest(host=pb.AgentAuth(agent_id="older-host", token=reply.host_token),
                                             wait_seconds=0.1))
    agents(server.address, ["plain-0"])  # joins by itself: it and the host's 3 may be joined by more such agents
    reply = join_members(stub, "host-mixed", ["x0"], capabilities={"population": "3"})
    pull_tasks(stub, pb.PullHostTasksRequest(host=pb.AgentAuth(agent_id="host-mixed", token=reply.host_token),
                                             wait_seconds=0.1))
    assert server.coordinator.registry.host("host-mixed") is not None
