"""The server's one deadline policy (server/deadline.py), and a coordinator that runs on the clock and member source
it is given (server/coordinator.py RoundClock, server/members.py) rather than ones it makes: real coordinator, raw
gRPC."""

from __future__ import annotations

import time

import grpc
import numpy as np

from fedpar.aggregation import build_strategy
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import PROTOCOL_VERSION
from fedpar.server.app import CoordinatorServer
from fedpar.server.config import CoordinatorConfig
from fedpar.server.coordinator import Coordinator
from fedpar.server.deadline import (closing_reason, cohort_size, seconds_left, secure_closing_reason,
                                   virtual_close_reason, wall_seconds)
from fedpar.server.populations import Populations
from fedpar.server.registry import AgentRegistry
from fedpar.server.rounds import AgentSlot, RoundState
from fedpar.server.virtual_clock import VirtualClock
from support.population_calls import host_stub, join_members, member_auth, pull_tasks, refused

SHAPE = (4,)


def test_a_round_closes_on_k_accepted_or_all_answered_and_its_tasks_carry_the_time_left():
    assert closing_reason(accepted=3, rejected=0, target=3, answering=5) == "target reached"
    assert closing_reason(accepted=2, rejected=3, target=3, answering=5) == "every sampled agent answered"
    assert closing_reason(accepted=2, rejected=2, target=3, answering=5) == ""  # still open: the deadline decides
    assert closing_reason(accepted=1, rejected=0, target=3, answering=1) == "every sampled agent answered"
    state = RoundState(1, 2, 1, 30.0, {"a": AgentSlot("a", "t")}, started=time.monotonic() - 10.0)
    assert 19.0 < seconds_left(state) <= 20.0
    state.started -= 100.0
    assert seconds_left(state) == 0.0
    state.close_if_done()
    assert not state.closed
    state.count_accepted(state.slots["a"])
    state.close_if_done()
    assert (state.closed, state.close_reason) == (True, "every sampled agent answered")  # K=2 > the one sampled
    config = CoordinatorConfig(clients_per_round=4, overselect=1.5, round_wall_seconds=99.0, deadline_seconds=7.0)
    assert (cohort_size(config, 100), cohort_size(config, 5)) == (6, 5)
    assert wall_seconds(config) == 7.0
    assert wall_seconds(CoordinatorConfig(virtual_clock=True, accept_populations=True, round_wall_seconds=99.0)) == 99.0


def test_a_secure_round_closes_on_k_masked_inputs_or_when_every_agent_that_shared_keys_uploaded():
    # the policy, not server/secure_round.py, words why a secure round closed
    assert secure_closing_reason(accepted=2, target=3, all_keyed_uploaded=True) == "every agent that shared keys uploaded"
    assert secure_closing_reason(accepted=3, target=3, all_keyed_uploaded=False) == "target reached"
    assert secure_closing_reason(accepted=3, target=3, all_keyed_uploaded=True) == "every agent that shared keys uploaded"
    assert secure_closing_reason(accepted=2, target=3, all_keyed_uploaded=False) == ""  # open: the deadline decides


def test_a_virtual_clock_round_closes_for_its_simulated_reason_unless_real_time_or_a_failure_ended_it():
    """Its real target is the number chosen, so 'target reached' in real time says nothing (QA: reported 14 of K 20,
    sim_close_reason 'deadline', close_reason 'target reached')."""
    for real in ("target reached", "every sampled agent answered", "every agent that shared keys uploaded"):
        assert virtual_close_reason(real, "deadline") == "deadline"
        assert virtual_close_reason(real, "target reached") == "target reached"
    assert virtual_close_reason("round wall timeout", "target reached") == "round wall timeout"
    assert virtual_close_reason("secure aggregation failed", "deadline") == "secure aggregation failed"


def test_a_coordinator_runs_on_the_clock_and_member_source_it_is_given(tmp_path):
    # The configuration says real time; the coordinator is handed a virtual clock and a hosts-only member source.
    config = CoordinatorConfig(rounds=1, clients_per_round=2, min_available=2, overselect=1.0, heartbeat_seconds=1.0,
                               deadline_seconds=30.0, accept_populations=True, metrics_path=tmp_path / "m.jsonl")
    members = Populations(config, AgentRegistry(config.liveness_timeout_seconds), hosts_only=True)
    coordinator = Coordinator(config, ["t0"], [np.zeros(SHAPE, np.float32)], build_strategy("fedavg"),
                              clock=VirtualClock(deadline_seconds=5.0, wall_seconds=60.0), members=members)
    assert coordinator.members is members and coordinator.registry is members.registry
    server = CoordinatorServer(coordinator)
    server.start()
    try:
        stub = host_stub(server)
        refused(lambda: stub.Join(pb.JoinRequest(agent_id="plain", num_examples=5, protocol_version=PROTOCOL_VERSION),
                                  timeout=10), grpc.StatusCode.FAILED_PRECONDITION, "only simulation hosts")
        joined = join_members(stub, "host-a", ["m0", "m1"])
        host = pb.AgentAuth(agent_id="host-a", token=joined.host_token)
        tasks: dict[str, pb.TrainTask] = {}
        end = time.monotonic() + 20
        while len(tasks) < 2 and time.monotonic() < end:
            reply = pull_tasks(stub, pb.PullHostTasksRequest(host=host, wait_seconds=1.0), timeout=10)
            tasks.update({t.agent_id: t.task for t in reply.tasks})
        assert all(t.virtual_clock and t.clock_deadline_seconds == 5.0 for t in tasks.values()), tasks
        estimates = [pb.FinishEstimate(agent_id=a, task_id=tasks[a].task_id, seconds=s)
                     for a, s in (("m0", 2.0), ("m1", 9.0))]  # m1 would finish after the simulated deadline
        go = pull_tasks(stub, pb.PullHostTasksRequest(host=host, wait_seconds=5.0, finish_estimates=estimates),
                                timeout=10).go
        assert list(go) == ["m0"]
        upload = pb.SmallUpload(header=pb.UploadHeader(
            auth=member_auth(joined, "m0"), round=1, task_id=tasks["m0"].task_id,
            num_examples=10, steps=1, tensors=[pb.TensorSpec(name="t0", dtype="float32", shape=list(SHAPE))],
            total_bytes=16), data=np.full(SHAPE, 2.0, np.float32).tobytes())
        assert stub.UploadSmall(upload, timeout=10).accepted
        assert server.wait(20)
    finally:
        server.stop()
    [row] = list(coordinator.metrics.read_rows())
    # m1 missed the simulated deadline: the round closed at it, though its one member let go answered in real time
    assert (row["status"], row["reported"], row["close_reason"]) == ("ok", 1, "deadline")
    assert (row["sim_round_seconds"], row["sim_close_reason"]) == (5.0, "deadline")
    np.testing.assert_array_equal(coordinator.weights[0], np.full(SHAPE, 2.0, np.float32))


def test_late_counts_only_updates_after_the_close_and_the_others_never_answered():
    """QA: drop-outs, dead hosts and the overselect surplus were counted 'late' (reported 10, late 55)."""
    statuses = {"a": "accepted", "r": "rejected", "l": "late", "p": "pending", "u": "uploading", "x": "lost"}
    state = RoundState(1, 1, 1, 30.0, {a: AgentSlot(a, "t", status=s) for a, s in statuses.items()})
    assert state.late() == 1
    assert state.unanswered("target reached") == {"silent": 1, "not_needed": 2}  # the lost one died: silent
    assert state.unanswered("deadline") == {"silent": 3, "not_needed": 0}


def test_an_update_begun_after_the_close_counts_late():
    from types import SimpleNamespace

    import grpc
    import pytest

    from fedpar.server.rounds import Refusal
    from fedpar.server.uploads import open_round

    state = RoundState(1, 1, 1, 30.0, {a: AgentSlot(a, "t") for a in "ab"})
    plane = SimpleNamespace(current=state, runs_rounds=True, current_round_id=1)
    assert open_round(plane, 1, "upload", "a") is state
    state.close("deadline")
    with pytest.raises(Refusal) as err:
        open_round(plane, 1, "upload", "a")
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "closed (deadline)" in err.value.message
    assert (state.late(), state.unanswered("deadline")) == (1, {"silent": 1, "not_needed": 0})


def test_a_secure_rounds_key_stages_wait_at_most_a_third_of_the_deadline():
    from fedpar.server.deadline import secure_stage_seconds

    assert secure_stage_seconds(CoordinatorConfig(deadline_seconds=15.0)) == 5.0  # not the default 30 s
    assert secure_stage_seconds(CoordinatorConfig(deadline_seconds=600.0, secagg_stage_seconds=30.0)) == 30.0
