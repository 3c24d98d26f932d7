"""The virtual clock at the coordinator: hosts report each sampled member's simulated finish time, only the first K
within the simulated deadline may download and upload, the round's simulated length and the clock are in the
metrics and the checkpoint, and what does not belong is refused. Real coordinator, raw gRPC over loopback."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import PROTOCOL_VERSION
from fedpar.server.checkpoint import load_checkpoint
from fedpar.server.rounds import AgentSlot
from fedpar.server.deadline import first_k_in_time as decide
from support.population_calls import (host_stub as _stub, join_members as _join, member_auth, pull_tasks,
                                     refused as _refused)

SHAPE = (8,)


def _slots(*ids):
    return {a: AgentSlot(a, "t") for a in ids}


def test_decide_takes_the_first_k_within_the_deadline():
    slots = _slots("a", "b", "c", "d", "e")
    d = decide({"a": 3.0, "b": 1.0, "c": 2.0, "d": 50.0, "e": -1.0}, slots, target=2, deadline=10.0)
    assert [s.agent_id for s in d.chosen] == ["b", "c"] and (d.seconds, d.reason) == (2.0, "target reached")
    d = decide({"a": 3.0, "b": 1.0, "c": 2.0, "d": 50.0, "e": -1.0}, slots, target=4, deadline=10.0)
    assert [s.agent_id for s in d.chosen] == ["b", "c", "a"] and (d.seconds, d.reason) == (10.0, "deadline")
    d = decide({"a": 3.0, "b": 1.0}, _slots("a", "b"), target=4, deadline=10.0)
    assert (d.seconds, d.reason) == (3.0, "every sampled agent answered")
    d = decide({"a": 1.0, "b": 1.0}, _slots("a", "b"), target=1, deadline=10.0)  # a tie goes to the smaller id
    assert [s.agent_id for s in d.chosen] == ["a"]
    d = decide({}, slots, target=2, deadline=10.0)  # nobody reported: nobody trains, the deadline passes
    assert (d.chosen, d.seconds, d.reason) == ([], 10.0, "deadline")


def _upload(stub, member: pb.AgentAuth, task: pb.TrainTask, value: float):
    return stub.UploadSmall(pb.SmallUpload(
        header=pb.UploadHeader(auth=member, round=task.round, task_id=task.task_id, num_examples=10, steps=1,
                               tensors=[pb.TensorSpec(name="t0", dtype="float32", shape=list(SHAPE))],
                               total_bytes=32),
        data=np.full(SHAPE, value, np.float32).tobytes()), timeout=10)


def _pull(stub, host, **kw) -> pb.PullHostTasksReply:
    return pull_tasks(stub, pb.PullHostTasksRequest(host=host, wait_seconds=1.0, **kw), timeout=10)


def _tasks(stub, host, n: int) -> dict[str, pb.TrainTask]:
    got: dict[str, pb.TrainTask] = {}
    end = time.monotonic() + 20
    while len(got) < n and time.monotonic() < end:
        got.update({t.agent_id: t.task for t in _pull(stub, host).tasks})
    assert len(got) == n
    return got


def test_only_the_first_k_in_simulated_time_train_and_the_clock_advances(start_coordinator, tmp_path):
    ids = [f"v{i}" for i in range(6)]
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, virtual_clock=True,
                               clients_per_round=3, overselect=2.0, min_available=6, rounds=2, deadline_seconds=10.0,
                               checkpoint_dir=tmp_path / "ckpt")
    stub = _stub(server)
    joined = _join(stub, "host-a", ids)
    tokens = {m: member_auth(joined, m).token for m in ids}
    host = pb.AgentAuth(agent_id="host-a", token=joined.host_token)
    _refused(lambda: _join(stub, "host-b", ["v0"]), grpc.StatusCode.INVALID_ARGUMENT, "")  # a taken id, as ever
    plain_join = pb.JoinRequest(agent_id="plain", num_examples=5, protocol_version=PROTOCOL_VERSION)
    _refused(lambda: stub.Join(plain_join, timeout=10),
             grpc.StatusCode.FAILED_PRECONDITION, "virtual clock")

    # round 1: six sampled; three finish within the deadline, first K=3 of them train, the round lasts 3 s
    tasks = _tasks(stub, host, 6)
    assert all(t.virtual_clock and t.round == 1 and t.clock_seconds == 0.0 for t in tasks.values())
    member = pb.AgentAuth(agent_id="v0", token=tokens["v0"])
    _refused(lambda: _upload(stub, member, tasks["v0"], 1.0), grpc.StatusCode.FAILED_PRECONDITION, "virtual clock")
    finish = {"v0": 3.0, "v1": 1.0, "v2": 50.0, "v3": 2.0, "v4": -1.0, "v5": 4.0}
    estimates = [pb.FinishEstimate(agent_id=a, task_id=tasks[a].task_id, seconds=s) for a, s in finish.items()]
    go = list(_pull(stub, host, finish_estimates=estimates).go)
    assert sorted(go) == ["v0", "v1", "v3"]
    _refused(lambda: _upload(stub, pb.AgentAuth(agent_id="v5", token=tokens["v5"]), tasks["v5"], 9.0),
             grpc.StatusCode.FAILED_PRECONDITION, "virtual clock")  # in time, but not among the first K
    for a in go:
        assert _upload(stub, pb.AgentAuth(agent_id=a, token=tokens[a]), tasks[a], 3.0).accepted

    # round 2: only one in time; the round lasts the whole simulated deadline
    tasks = _tasks(stub, host, 6)
    assert all(t.round == 2 and t.clock_seconds == 3.0 for t in tasks.values())
    estimates = [pb.FinishEstimate(agent_id=a, task_id=t.task_id, seconds=5.0 if a == "v2" else 11.0)
                 for a, t in tasks.items()]
    assert list(_pull(stub, host, finish_estimates=estimates).go) == ["v2"]
    assert _upload(stub, pb.AgentAuth(agent_id="v2", token=tokens["v2"]), tasks["v2"], 6.0).accepted
    assert server.wait(20)

    rows = list(server.coordinator.metrics.read_rows())
    # round 1 reached K in simulated time: the 3 not let train were not needed; round 2 closed at its simulated
    # deadline: the 5 not let train missed it
    assert [(r["status"], r["reported"], r["late"], r["not_needed"], r["silent"]) for r in rows] == \
        [("ok", 3, 0, 3, 0), ("ok", 1, 0, 0, 5)]
    assert [(r["sim_round_seconds"], r["sim_seconds"], r["sim_close_reason"]) for r in rows] == \
        [(3.0, 3.0, "target reached"), (10.0, 13.0, "deadline")]
    np.testing.assert_array_equal(server.coordinator.weights[0], np.full(SHAPE, 6.0, np.float32))
    assert load_checkpoint(tmp_path / "ckpt").state["clock_seconds"] == 13.0  # a restart goes on from here


def test_estimates_are_checked(start_coordinator):
    plain = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, min_available=2)
    stub = _stub(plain)
    joined = _join(stub, "host-a", ["m0", "m1"])
    host = pb.AgentAuth(agent_id="host-a", token=joined.host_token)
    tasks = _tasks(stub, host, 2)
    assert not any(t.virtual_clock for t in tasks.values())
    estimate = pb.FinishEstimate(agent_id="m0", task_id=tasks["m0"].task_id, seconds=1.0)
    _refused(lambda: _pull(stub, host, finish_estimates=[estimate]), grpc.StatusCode.FAILED_PRECONDITION,
             "real time")

    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, virtual_clock=True,
                               min_available=3)
    stub = _stub(server)
    a = _join(stub, "host-a", ["a0", "a1"])
    b = _join(stub, "host-b", ["b0"])
    host_a = pb.AgentAuth(agent_id="host-a", token=a.host_token)
    _tasks(stub, pb.AgentAuth(agent_id="host-b", token=b.host_token), 1)
    tasks = _tasks(stub, host_a, 2)
    _refused(lambda: _pull(stub, host_a, finish_estimates=[pb.FinishEstimate(agent_id="b0", task_id="x",
                                                                             seconds=1.0)]),
             grpc.StatusCode.PERMISSION_DENIED, "not a member of host")
    _refused(lambda: _pull(stub, host_a, finish_estimates=[pb.FinishEstimate(
        agent_id="a0", task_id=tasks["a0"].task_id, seconds=float("nan"))]), grpc.StatusCode.INVALID_ARGUMENT, "finite")
    _refused(lambda: _pull(stub, host_a, finish_estimates=[pb.FinishEstimate(agent_id="a0", task_id="forged",
                                                                             seconds=1.0)]),
             grpc.StatusCode.FAILED_PRECONDITION, "not the current task")


def test_the_virtual_clock_needs_simulation_hosts_and_runs_with_ranks_and_secure_aggregation():
    from fedpar.server.config import CoordinatorConfig
    with pytest.raises(ValueError, match="accept_populations"):
        CoordinatorConfig(virtual_clock=True).validate()
    CoordinatorConfig(virtual_clock=True, accept_populations=True, aggregator_ranks=2,
                      secure_aggregation=True).validate()


def test_the_go_aheads_of_a_big_cohort_come_in_replies_each_within_max_chunk_bytes(start_coordinator):
    # a reply took every member the clock let go: one id each, past --max-chunk-bytes for a big enough cohort
    ids = [f"g{i:03d}" for i in range(600)]
    limit = 1024
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, virtual_clock=True,
                               clients_per_round=600, overselect=1.0, min_available=600, deadline_seconds=10.0,
                               max_chunk_bytes=limit)
    stub = _stub(server)
    joined = _join(stub, "host-g", ids)
    host = pb.AgentAuth(agent_id="host-g", token=joined.host_token)
    tasks = _tasks(stub, host, 600)
    estimates = [pb.FinishEstimate(agent_id=a, task_id=t.task_id, seconds=1.0) for a, t in tasks.items()]
    replies = [_pull(stub, host, finish_estimates=estimates)]
    while sum(len(r.go) for r in replies) < 600 and len(replies) < 100:
        replies.append(_pull(stub, host))
    assert sorted(m for r in replies for m in r.go) == ids and len(replies) > 1
    assert all(r.ByteSize() <= limit for r in replies), [r.ByteSize() for r in replies]
