"""A process started again under the id of a sampled agent or simulation host whose process died holding its open task
(kill -9, then the same command again): the coordinator hands the new process that task of the round still running,
so the round closes as soon as it answers, not at its deadline; the same process joining again is not handed it twice,
and a task that cannot be handed out again (a secure round's) counts as failed at once, said in one line. Real
coordinator, raw gRPC over loopback; a process's death is its long-poll or task stream cut, as the kernel cuts them."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import numpy as np

from fedpar.aggregation import build_strategy
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import CoordinatorStub, layout_to_pb, member_token
from fedpar.server.app import CoordinatorServer
from fedpar.server.config import CoordinatorConfig
from fedpar.server.flower_rounds import FlowerCoordinator
from support.population_calls import host_stub, pull_tasks, upload_batch
from support.scripted_agent import ScriptedAgent

SHAPE = (8,)
DEADLINE = 60.0  # no round here may wait it out: each closes within seconds


def _process(address: str, agent_id: str, incarnation: str, replaces_token: str = "") -> ScriptedAgent:
    """A process of ``agent_id`` that drew ``incarnation`` (a fresh process presents no session it held)."""
    agent = ScriptedAgent.__new__(ScriptedAgent)
    agent.channel = grpc.insecure_channel(address)
    agent.stub, agent.agent_id, agent.max_chunk = CoordinatorStub(agent.channel), agent_id, 64 << 10
    reply = agent._join(pb.JoinRequest(agent_id=agent_id, num_examples=100, incarnation=incarnation,
                                       replaces_token=replaces_token), timeout=30)
    agent.auth = pb.AgentAuth(agent_id=agent_id, token=reply.token)
    return agent


def _killed_while_polling(agent: ScriptedAgent, finished_task_id: str = "") -> None:
    """``agent``'s process dies in the middle of a long-poll: its channel goes, the call is cut."""
    call = agent.stub.PullTask.future(pb.PullTaskRequest(auth=agent.auth, wait_seconds=5.0,
                                                         finished_task_id=finished_task_id), timeout=10)
    time.sleep(0.3)
    call.cancel()
    agent.close()


def _upload(agent: ScriptedAgent, task: pb.TrainTask, server) -> bool:
    layout = server.coordinator.layout
    arrays = [w + 1.0 for w in agent.download(task, layout)]
    return agent.upload(task, arrays, 100, names=server.coordinator.names).accepted


def _round_closed(server, timeout: float = 20.0) -> dict:
    end = time.monotonic() + timeout
    while not (rows := list(server.coordinator.metrics.read_rows())):
        assert time.monotonic() < end, "the round did not close"
        time.sleep(0.05)
    return rows[0]


def test_a_restarted_agent_gets_its_open_task_and_the_round_closes_long_before_its_deadline(start_coordinator,
                                                                                           caplog):
    caplog.set_level(logging.INFO, logger="fedpar.server")
    server = start_coordinator([np.zeros(SHAPE, np.float32)], min_available=2, clients_per_round=2,
                               deadline_seconds=DEADLINE, liveness_timeout_seconds=60.0)
    alice = _process(server.address, "alice", "process-a")
    bob = ScriptedAgent(server.address, "bob")
    try:
        task = alice.task()
        alice.download(task, server.coordinator.layout)  # its download completed: no longer re-delivered as lost
        assert _upload(bob, bob.task(), server)
        _killed_while_polling(alice)

        alice = _process(server.address, "alice", "process-b")  # the same command, started again
        again = alice.task(timeout=5)
        assert (again.round, again.task_id) == (task.round, task.task_id)
        assert 0 < again.deadline_seconds < task.deadline_seconds
        assert _upload(alice, again, server)
        row = _round_closed(server)
    finally:
        alice.close()
        bob.close()
    assert (row["status"], row["reported"], row["close_reason"]) == ("ok", 2, "target reached"), row
    assert row["round_seconds"] < DEADLINE / 4, row
    said = [r.getMessage() for r in caplog.records if "started again" in r.getMessage()]
    assert said == ["round 1: agent 'alice' started again; the open task of alice handed to its new process"], said
    assert np.allclose(server.coordinator.weights[0], 1.0)  # the mean of two updates of ones


def test_the_same_process_joining_again_is_not_handed_its_task_twice(start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], min_available=2, clients_per_round=2,
                               deadline_seconds=DEADLINE, liveness_timeout_seconds=60.0)
    alice = _process(server.address, "alice", "process-a")
    bob = ScriptedAgent(server.address, "bob")
    try:
        task = alice.task()
        alice.download(task, server.coordinator.layout)
        old = alice.auth.token
        alice.close()
        alice = _process(server.address, "alice", "process-a", replaces_token=old)  # its session lost, say
        reply = alice.stub.PullTask(pb.PullTaskRequest(auth=alice.auth, wait_seconds=0.5), timeout=10)
        assert reply.WhichOneof("kind") != "task", reply  # it trains the task it holds; nothing twice
        assert _upload(alice, task, server) and _upload(bob, bob.task(), server)
        assert _round_closed(server)["reported"] == 2
    finally:
        alice.close()
        bob.close()


def test_an_agent_counted_lost_gets_its_task_back_when_it_comes_again_in_the_round(start_coordinator, caplog):
    """Killed while training (heartbeating, no long-poll open): a new process takes its place once its liveness ran
    out, which has counted it lost by then; the round, still waiting for another, takes its update after all."""
    caplog.set_level(logging.INFO, logger="fedpar.server")
    server = start_coordinator([np.zeros(SHAPE, np.float32)], min_available=2, clients_per_round=2,
                               deadline_seconds=DEADLINE, heartbeat_seconds=0.3, liveness_timeout_seconds=1.0)
    alice = _process(server.address, "alice", "process-a")
    bob = ScriptedAgent(server.address, "bob")
    try:
        task = alice.task()
        alice.close()
        bob_task = bob.task()
        end = time.monotonic() + 10
        while not any("went silent" in r.getMessage() for r in caplog.records):
            bob.stub.Heartbeat(pb.HeartbeatRequest(auth=bob.auth), timeout=10)  # bob trains on
            assert time.monotonic() < end
            time.sleep(0.2)
        assert server.coordinator.current.slots["alice"].status == "lost"

        alice = _process(server.address, "alice", "process-b")
        again = alice.task(timeout=5)
        assert again.task_id == task.task_id
        assert _upload(alice, again, server) and _upload(bob, bob_task, server)
        row = _round_closed(server)
    finally:
        alice.close()
        bob.close()
    assert (row["status"], row["reported"], row["late"]) == ("ok", 2, 0), row
    assert row["round_seconds"] < DEADLINE / 4, row


def test_a_restarted_host_gets_its_members_open_tasks(start_coordinator, caplog):
    caplog.set_level(logging.INFO, logger="fedpar.server")
    server = start_coordinator([np.zeros(SHAPE, np.float32)], min_available=3, clients_per_round=3,
                               deadline_seconds=DEADLINE, liveness_timeout_seconds=60.0, accept_populations=True)
    members = ["m0", "m1", "m2"]

    def join(incarnation: str) -> pb.JoinPopulationReply:
        return stub.JoinPopulation(pb.JoinPopulationRequest(
            host=pb.AgentAuth(agent_id="h"), member_ids="\n".join(members), num_examples=[10] * 3,
            incarnation=incarnation), timeout=30)

    def pull(token: str) -> pb.PullHostTasksReply:
        end = time.monotonic() + 10
        while not (reply := pull_tasks(stub, pb.PullHostTasksRequest(host=pb.AgentAuth(agent_id="h", token=token),
                                                                     wait_seconds=1.0))).tasks:
            assert time.monotonic() < end
        return reply

    def send(token: str, tasks: list[pb.HostedTask], weights) -> pb.HostUploadResults:
        request = pb.HostUploads(host=pb.AgentAuth(agent_id="h", token=token))
        layout = server.coordinator.layout
        for hosted in tasks:
            auth = pb.AgentAuth(agent_id=hosted.agent_id, token=member_token(token, hosted.agent_id))
            header = pb.UploadHeader(auth=auth, round=hosted.task.round, task_id=hosted.task.task_id, num_examples=10,
                                     steps=1, tensors=layout_to_pb(layout), total_bytes=layout.total_bytes)
            request.uploads.add(header=header, data=np.ascontiguousarray(weights[0] + 1.0).tobytes())
        return upload_batch(stub, request)

    stub = host_stub(server)
    first = join("process-a")
    tasks = pull(first.host_token).tasks  # (each stream here ends after one call: as a killed process's does)
    assert sorted(t.agent_id for t in tasks) == members
    weights = [np.zeros(SHAPE, np.float32)]
    assert send(first.host_token, tasks[:1], weights).results[0].accepted  # one member answered before the kill
    pull_tasks(stub, pb.PullHostTasksRequest(host=pb.AgentAuth(agent_id="h", token=first.host_token)))  # its last

    second = join("process-b")
    again = pull(second.host_token).tasks
    assert sorted(t.agent_id for t in again) == sorted(t.agent_id for t in tasks[1:])  # not the one that answered
    assert {t.task.task_id for t in again} <= {t.task.task_id for t in tasks}
    assert all(r.accepted for r in send(second.host_token, list(again), weights).results)
    row = _round_closed(server)
    assert (row["status"], row["reported"], row["close_reason"]) == ("ok", 3, "target reached"), row
    assert row["round_seconds"] < DEADLINE / 4, row
    said = [r.getMessage() for r in caplog.records if "started again" in r.getMessage()]
    assert said == ["round 1: host 'h' started again; the open tasks of 2 (m1, m2) handed to its new process"], said


def test_a_secure_round_counts_a_restarted_agent_as_failed_at_once_in_one_line(start_coordinator, caplog):
    caplog.set_level(logging.INFO, logger="fedpar.server")
    server = start_coordinator([np.zeros(SHAPE, np.float32)], min_available=3, clients_per_round=3,
                               deadline_seconds=DEADLINE, liveness_timeout_seconds=60.0, secure_aggregation=True)
    alice = _process(server.address, "alice", "process-a")
    others = [ScriptedAgent(server.address, a) for a in ("bob", "carol")]
    try:
        alice.task()
        _killed_while_polling(alice)
        alice = _process(server.address, "alice", "process-b")
        reply = alice.stub.PullTask(pb.PullTaskRequest(auth=alice.auth, wait_seconds=0.5), timeout=10)
        assert reply.WhichOneof("kind") != "task", reply  # its key exchange cannot be replayed
        state = server.coordinator.current
        assert state.slots["alice"].status == "lost" and state.answering == 2 and not state.closed
    finally:
        alice.close()
        for agent in others:
            agent.close()
    said = [r.getMessage() for r in caplog.records if "started again" in r.getMessage()]
    assert said == ["round 1: agent 'alice' started again; the open task of alice cannot be handed out again (secure "
                    "aggregation's key setup fixed this round's masks): counted as failed"], said


def test_a_flower_app_run_hands_a_restarted_agent_its_message_again():
    """A Flower App run's rounds are Messages (no round mode of fedpar's): the restarted agent is handed its open
    Message again."""
    sent = threading.Event()

    def app_main(coordinator: FlowerCoordinator):
        asyncio.run_coroutine_threadsafe(coordinator.exchange({"alice": (b"the message", None)}, timeout=30.0,
                                                              message_type="train", flower_round=1),
                                         coordinator.loop).result()
        return None, {}

    config = CoordinatorConfig(min_available=1, deadline_seconds=DEADLINE, heartbeat_seconds=1.0,
                               liveness_timeout_seconds=60.0)
    server = CoordinatorServer(FlowerCoordinator(config, build_strategy("fedavg"), app_main))
    server.start()
    alice = _process(server.address, "alice", "process-a")
    try:
        task = alice.task()
        assert task.flower_message == b"the message"
        _killed_while_polling(alice, task.task_id)  # (a poll not done with it is handed it again: no long-poll)
        alice = _process(server.address, "alice", "process-b")
        again = alice.task(timeout=5)
        assert (again.task_id, again.flower_message) == (task.task_id, b"the message")
        sent.set()
    finally:
        alice.close()
        server.stop(grace=0)
    assert sent.is_set()
