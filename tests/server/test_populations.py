"""Simulated populations at the coordinator: a host registers many members in one call, each member has its own
session, only sampled members' tasks reach the host, the members are live while the host calls (and leave the
registry with a host gone quiet), and the coordinator refuses what it must. Real coordinator, raw gRPC over loopback."""

from __future__ import annotations

import time

import grpc
import pytest
import numpy as np

from fedpar.protocol import fedpar_pb2 as pb
from support.population_calls import (host_stub as _stub, join_members as _join, member_auth as _member,
                                     pull_tasks, refused as _refused, upload_batch)
from support.scripted_agent import ScriptedAgent

SHAPE = (8,)


def test_only_sampled_members_get_tasks_and_each_uploads_with_its_own_session(start_coordinator):
    ids = [f"v{i:05d}" for i in range(3000)]
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, clients_per_round=5,
                               min_available=3000, max_population_join=2000, rounds=2)
    stub = _stub(server)
    first = _join(stub, "host-a", ids[:2000])
    second = _join(stub, "host-a", ids[2000:], token=first.host_token)  # more members, same host session
    assert second.host_token == first.host_token and len(server.coordinator.registry) == 3000
    host = pb.AgentAuth(agent_id="host-a", token=first.host_token)
    for round_id in (1, 2):
        got: list[pb.HostedTask] = []
        end = time.monotonic() + 20
        while len(got) < 5 and time.monotonic() < end:
            got += pull_tasks(stub, pb.PullHostTasksRequest(host=host, wait_seconds=1.0), timeout=10).tasks
        assert len(got) == 5 and len({t.agent_id for t in got}) == 5
        assert all(t.task.round == round_id for t in got)
        for hosted in got:  # each sampled member uploads with its own session token
            member = _member(first, hosted.agent_id)
            reply = stub.UploadSmall(pb.SmallUpload(
                header=pb.UploadHeader(auth=member, round=hosted.task.round, task_id=hosted.task.task_id,
                                       num_examples=10, steps=1, tensors=[pb.TensorSpec(name="t0", dtype="float32",
                                                                                        shape=list(SHAPE))],
                                       total_bytes=32),
                data=np.full(SHAPE, round_id, np.float32).tobytes()), timeout=10)
            assert reply.accepted
    assert server.wait(20)
    rows = list(server.coordinator.metrics.read_rows())
    assert [r["status"] for r in rows] == ["ok", "ok"] and all(r["reported"] == 5 for r in rows)
    np.testing.assert_array_equal(server.coordinator.weights[0], np.full(SHAPE, 2.0, np.float32))
    reply = pull_tasks(stub, pb.PullHostTasksRequest(host=host, wait_seconds=1.0), timeout=10)
    assert "training finished" in reply.shutdown_reason
    assert server.coordinator.registry.snapshot() == {}  # the host joins its members again after a restart


def test_members_are_live_while_their_host_calls_and_leave_the_registry_with_it(start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, min_available=50,
                               liveness_timeout_seconds=1.0, heartbeat_seconds=0.5)
    stub = _stub(server)
    reply = _join(stub, "host-b", [f"m{i}" for i in range(3)], examples=10)
    registry = server.coordinator.registry
    assert len(registry.live_ids()) == 3
    time.sleep(1.3)
    assert registry.live_ids() == [] and len(registry) == 0 and registry.host("host-b") is None  # it went quiet
    _refused(lambda: pull_tasks(stub, pb.PullHostTasksRequest(
        host=pb.AgentAuth(agent_id="host-b", token=reply.host_token), wait_seconds=0.0), timeout=10),
        grpc.StatusCode.UNAUTHENTICATED, "call JoinPopulation again")
    _join(stub, "host-b", [f"m{i}" for i in range(3)], examples=99)  # back: its members' counts stay as first joined
    assert len(registry.live_ids()) == 3 and {registry.get(f"m{i}").num_examples for i in range(3)} == {10}


def test_what_a_coordinator_refuses(start_coordinator):
    closed = start_coordinator([np.zeros(SHAPE, np.float32)])
    _refused(lambda: _join(_stub(closed), "h", ["x"]), grpc.StatusCode.FAILED_PRECONDITION, "--accept-populations")
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, max_population_join=10,
                               max_agents=20, min_available=5)
    stub = _stub(server)
    agent = ScriptedAgent(server.address, "agent-1")
    try:
        _refused(lambda: _join(stub, "h", [f"m{i}" for i in range(11)]), grpc.StatusCode.INVALID_ARGUMENT,
                 "at most 10 per call")
        _refused(lambda: _join(stub, "h", ["agent-1"]), grpc.StatusCode.INVALID_ARGUMENT, "registered already")
        _refused(lambda: _join(stub, "h", ["ok", "bad\t"]), grpc.StatusCode.INVALID_ARGUMENT, "printable")
        _refused(lambda: _join(stub, "h", ["ok", "ok"]), grpc.StatusCode.INVALID_ARGUMENT, "'ok' appears twice")
        _refused(lambda: _join(stub, "h", ["ok", ""]), grpc.StatusCode.INVALID_ARGUMENT, "1..128 printable")
        _refused(lambda: _join(stub, "h", ["ok", "m1"], away=[2]), grpc.StatusCode.INVALID_ARGUMENT,
                 "outside the 2 member ids")
        _refused(lambda: stub.JoinPopulation(pb.JoinPopulationRequest(host=pb.AgentAuth(agent_id="h"),
                                                                      member_ids="a\nb", num_examples=[3]), timeout=10),
                 grpc.StatusCode.INVALID_ARGUMENT, "2 member ids but 1 example counts")
        _refused(lambda: stub.JoinPopulation(pb.JoinPopulationRequest(host=pb.AgentAuth(agent_id="h")), timeout=10),
                 grpc.StatusCode.INVALID_ARGUMENT, "must name its members in member_ids")
        _refused(lambda: _join(stub, "h", ["zero"], examples=0), grpc.StatusCode.INVALID_ARGUMENT,
                 "--max-examples-per-agent")
        assert len(server.coordinator.registry) == 1  # a refused call registers none of its members
        first = _join(stub, "h", [f"m{i}" for i in range(10)])
        _refused(lambda: _join(stub, "h", ["m99"], token="forged"), grpc.StatusCode.UNAUTHENTICATED, "bad session")
        _refused(lambda: _join(stub, "h2", [f"n{i}" for i in range(10)]), grpc.StatusCode.RESOURCE_EXHAUSTED,
                 "--max-agents 20")
        _refused(lambda: _join(stub, "h2", ["m1"]), grpc.StatusCode.INVALID_ARGUMENT, "not by host 'h2'")
        _refused(lambda: pull_tasks(stub, pb.PullHostTasksRequest(host=pb.AgentAuth(agent_id="h", token="x")),
                                            timeout=10), grpc.StatusCode.UNAUTHENTICATED, "bad session")
        member = pb.AgentAuth(agent_id="m0", token=_member(first, "m1").token)  # another member's token
        _refused(lambda: stub.Heartbeat(pb.HeartbeatRequest(auth=member), timeout=10),
                 grpc.StatusCode.UNAUTHENTICATED, "bad session token")
    finally:
        agent.close()


def test_a_big_cohort_of_one_host_comes_in_replies_of_bounded_size_with_one_copy_of_a_small_model(start_coordinator):
    from fedpar.server.populations import MAX_HOSTED_TASKS
    ids = [f"w{i:04d}" for i in range(700)]
    weights = np.arange(12_000, dtype=np.float32)  # 48 KB: small enough to travel with the tasks
    server = start_coordinator([weights], accept_populations=True, clients_per_round=600, min_available=700,
                               max_chunk_bytes=1 << 20)
    stub = _stub(server)
    reply = _join(stub, "host-c", ids)
    host = pb.AgentAuth(agent_id="host-c", token=reply.host_token)
    first = pull_tasks(stub, pb.PullHostTasksRequest(host=host, wait_seconds=5.0), timeout=10)
    second = pull_tasks(stub, pb.PullHostTasksRequest(host=host, wait_seconds=5.0), timeout=10)
    assert (len(first.tasks), len(second.tasks)) == (MAX_HOSTED_TASKS, 600 - MAX_HOSTED_TASKS)
    assert first.ByteSize() < 2 * weights.nbytes + 200 * MAX_HOSTED_TASKS  # the weights once, not 512 times
    assert np.frombuffer(first.weights, np.float32).tolist() == weights.tolist()
    assert all(not t.task.weights for t in first.tasks)
    assert len({t.agent_id for t in [*first.tasks, *second.tasks]}) == 600
    assert np.frombuffer(second.weights, np.float32).tolist() == weights.tolist()
    assert server.coordinator.current.download_bytes == 600 * weights.nbytes  # sent once, counted per member


def test_a_cohort_whose_tasks_pass_max_chunk_bytes_comes_in_replies_each_within_it(start_coordinator):
    """A host's reply took up to 512 tasks whatever their size: a Flower message rides in each member's task, so 210
    clients of a 10 KB model on two hosts passed the 1 MiB default and every pull failed (RESOURCE_EXHAUSTED, retried
    until the round's deadline, and the run ended with nothing trained)."""
    ids = [f"c{i:03d}" for i in range(300)]
    limit = 4096
    weights = np.arange(8, dtype=np.float32)  # small enough to ride inline
    server = start_coordinator([weights], accept_populations=True, clients_per_round=300, min_available=300,
                               max_chunk_bytes=limit)
    stub = _stub(server)
    reply = _join(stub, "host-d", ids)
    host = pb.AgentAuth(agent_id="host-d", token=reply.host_token)
    replies = []
    while sum(len(r.tasks) for r in replies) < 300:
        replies.append(pull_tasks(stub, pb.PullHostTasksRequest(host=host, wait_seconds=5.0), timeout=10))
        assert replies[-1].tasks, "a pull came back empty with tasks still due"
    assert len(replies) > 1 and all(r.ByteSize() <= limit for r in replies), [r.ByteSize() for r in replies]
    assert sorted(t.agent_id for r in replies for t in r.tasks) == ids  # each member's task once
    assert all(np.frombuffer(r.weights, np.float32).tolist() == weights.tolist() for r in replies)
    assert server.coordinator.current.download_bytes == 300 * weights.nbytes  # sent once a reply, counted per member


def test_members_reported_away_are_not_live_until_they_are_back(start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, min_available=50)
    stub = _stub(server)
    reply = _join(stub, "host-d", [f"p{i}" for i in range(6)], examples=5, away=[1, 3, 5])
    registry = server.coordinator.registry
    assert registry.live_ids() == ["p0", "p2", "p4"]
    host = pb.AgentAuth(agent_id="host-d", token=reply.host_token)
    pull_tasks(stub, pb.PullHostTasksRequest(host=host, wait_seconds=0.0, away=["p0", "not-mine"], back=["p1"]),
                       timeout=10)
    assert registry.live_ids() == ["p1", "p2", "p4"]


def _until(check, seconds: float = 10.0) -> None:
    """Wait until ``check()`` holds (assert it does within ``seconds``)."""
    end = time.monotonic() + seconds
    while not check() and time.monotonic() < end:
        time.sleep(0.05)
    assert check()


def test_members_away_by_their_trace_are_not_waited_for_and_the_progress_bar_counts_the_live_ones(start_coordinator):
    """A round needing 6 starts once 6 have joined, 3 of them online: the 3 offline by their trace are not waited for
    (it waited up to its --min-available limit), and the bar, following from another thread, shows the live ones (it
    showed the registry's size: members offline as joined)."""
    import io

    from fedpar.cli.progress import LiveBar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, min_available=6,
                               clients_per_round=6, joined_count_as_available=True)  # as simulate's real clock
    stub = _stub(server)
    _join(stub, "host-e", ["q0", "q1", "q2"], away=[1])
    _until(lambda: server.coordinator.members.live_seen == 2)
    terminal = Terminal()
    bar = LiveBar(stream=terminal)
    bar.follow(server.coordinator)
    bar.close()
    assert "clients joining" in terminal.getvalue() and "2/6" in terminal.getvalue(), terminal.getvalue()
    assert server.coordinator.current is None  # 3 of the 6 have not joined yet
    _join(stub, "host-f", ["q3", "q4", "q5"], away=[0, 2])
    _until(lambda: server.coordinator.current is not None)
    assert server.coordinator.current.sampled == 3  # q0, q2 and q4: the live ones


def test_a_wait_with_every_member_offline_by_its_trace_ends_in_a_line_naming_the_trace_flags(start_coordinator):
    from fedpar.server.members import TooFewMembers

    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, min_available=2,
                               wait_for_agents_seconds=1.0, joined_count_as_available=True)
    _join(_stub(server), "host-g", ["r0", "r1"], away=[0, 1])
    with pytest.raises(TooFewMembers) as err:
        server.wait(20)
    assert str(err.value).startswith("0 of the 2 clients that joined came online in 1 s: their availability "
                                      "traces keep the others offline"), err.value  # was 'need min_available=2'
    assert "--trace-day-seconds" in str(err.value) and "--clock virtual" in str(err.value)


def test_a_secure_round_waits_for_two_members_online_however_many_are_offline_by_their_trace(start_coordinator):
    """Masking cannot hide a lone update: with one member online of the three joined, no secure round starts."""
    from fedpar.server.members import TooFewMembers

    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, min_available=3,
                               clients_per_round=3, secure_aggregation=True, wait_for_agents_seconds=1.0,
                               joined_count_as_available=True)
    _join(_stub(server), "host-h", ["s0", "s1", "s2"], away=[0, 1])
    with pytest.raises(TooFewMembers, match=r"^1 of the 3 clients that joined came online in 1 s \(a secure round "
                                            r"needs 2\)"):
        server.wait(20)


def test_a_host_sends_its_members_updates_in_one_message_each_checked_on_its_own(start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, clients_per_round=4,
                               min_available=5, rounds=1)
    stub = _stub(server)
    a = _join(stub, "host-a", ["a0", "a1", "a2", "a3"])
    b = _join(stub, "host-b", ["b0"])
    tokens = {m: _member(a, m).token for m in ["a0", "a1", "a2", "a3"]}
    host = pb.AgentAuth(agent_id="host-a", token=a.host_token)
    tasks: dict[str, pb.TrainTask] = {}
    end = time.monotonic() + 20
    while len(tasks) < 4 and time.monotonic() < end:  # four of the five are sampled; b0 may be one of them
        for auth in (host, pb.AgentAuth(agent_id="host-b", token=b.host_token)):
            tasks.update({t.agent_id: t.task for t in pull_tasks(stub, 
                pb.PullHostTasksRequest(host=auth, wait_seconds=0.2), timeout=10).tasks})
    mine = sorted(m for m in tasks if m.startswith("a"))
    assert len(mine) >= 3

    def small(member: str, value: float, token: str | None = None, nbytes: int = 32) -> pb.SmallUpload:
        task = tasks.get(member) or next(iter(tasks.values()))
        return pb.SmallUpload(header=pb.UploadHeader(
            auth=pb.AgentAuth(agent_id=member, token=tokens.get(member, "") if token is None else token),
            round=task.round, task_id=task.task_id, num_examples=10, steps=1,
            tensors=[pb.TensorSpec(name="t0", dtype="float32", shape=list(SHAPE))], total_bytes=32),
            data=np.full(SHAPE, value, np.float32).tobytes()[:nbytes])

    batch = [small(mine[0], 2.0), small(mine[1], 4.0, token="forged"), small("b0", 8.0, token=_member(b, "b0").token),
             small(mine[1], 16.0, nbytes=16), small(mine[0], 2.0), pb.SmallUpload()]
    results = upload_batch(stub, pb.HostUploads(host=host, uploads=batch)).results
    codes = [grpc.StatusCode.OK if r.accepted else next(c for c in grpc.StatusCode if c.value[0] == r.code)
             for r in results]
    assert codes == [grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                     grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS,
                     grpc.StatusCode.INVALID_ARGUMENT], [r.message for r in results]
    assert "not a member of host 'host-a'" in results[2].message and "UploadHeader" in results[5].message
    assert server.coordinator.current.accepted == 1  # only the good update counts so far
    _refused(lambda: upload_batch(stub, pb.HostUploads(host=pb.AgentAuth(agent_id="host-a", token="x"),
                                                       uploads=[small(mine[2], 1.0)])),
             grpc.StatusCode.UNAUTHENTICATED, "")


def test_a_host_or_agent_of_another_protocol_version_hears_it_in_one_line_and_a_newer_host_stops(start_coordinator,
                                                                                                  monkeypatch):
    from fedpar.client import links
    from fedpar.datasets import load_dataset
    from fedpar.protocol.codec import PROTOCOL_VERSION
    from fedpar.simulations.agents import WorkerConfig, worker_task
    from fedpar.simulations.population import PopulationSlice, host_population

    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, min_available=5)
    stub = _stub(server)
    older = PROTOCOL_VERSION - 1  # 1: a host that sent one PopulationMember message per member
    said = f"protocol version {older} is not supported (coordinator speaks {PROTOCOL_VERSION}); upgrade the"
    _refused(lambda: stub.JoinPopulation(pb.JoinPopulationRequest(
        host=pb.AgentAuth(agent_id="old-host"), protocol_version=older, member_ids="m0", num_examples=[3]),
        timeout=10), grpc.StatusCode.FAILED_PRECONDITION, f"{said} host")
    _refused(lambda: stub.Join(pb.JoinRequest(agent_id="old-agent", num_examples=3, protocol_version=older),
                               timeout=10), grpc.StatusCode.FAILED_PRECONDITION, f"{said} agent")
    assert len(server.coordinator.registry) == 0
    monkeypatch.setattr(links, "PROTOCOL_VERSION", PROTOCOL_VERSION + 1)  # a host newer than this coordinator
    splits = load_dataset("digits")
    population = PopulationSlice.of("new-host", np.arange(4), np.full(4, 10), np.zeros(4))
    worker = WorkerConfig(server=server.address, population=population, clients=4, device="cpu")
    runtime = host_population(server.address, population, worker_task(worker, splits), worker.partition_of, 0,
                              seats=1, poll_seconds=1.0)
    started = time.monotonic()
    with pytest.raises(links.FatalAgentError) as refusal:
        runtime.run()  # refused at once, not waiting for tasks that never come
    line = str(refusal.value)
    assert time.monotonic() - started < 10 and "\n" not in line
    assert line == (f"new-host: coordinator refused: FAILED_PRECONDITION: protocol version {PROTOCOL_VERSION + 1} "
                    f"is not supported (coordinator speaks {PROTOCOL_VERSION}); upgrade the coordinator")


def test_a_host_long_polls_on_one_task_stream_a_second_is_refused_and_another_host_cannot_speak_on_it(
        start_coordinator):
    """Each long-poll of the host's stream answered in order; a second stream of the same host is refused while the
    first is open (it holds one of the coordinator's places for its life), and a message of another host ends it."""
    import queue

    from fedpar.protocol.codec import SERVICE_NAME

    server = start_coordinator([np.zeros(4, np.float32)], accept_populations=True, clients_per_round=2,
                               min_available=4, rounds=1)
    stub = _stub(server)
    a = _join(stub, "host-a", ["a0", "a1"])
    b = _join(stub, "host-b", ["b0", "b1"])
    channel = grpc.insecure_channel(server.address)

    def stream():
        requests: queue.SimpleQueue = queue.SimpleQueue()
        replies = channel.stream_stream(f"/{SERVICE_NAME}/HostTaskStream")(iter(requests.get, None), timeout=20)
        return requests, replies

    host = pb.AgentAuth(agent_id="host-a", token=a.host_token)
    first, first_replies = stream()
    tasks = []
    for _ in range(3):  # the round opens once the four members are live: its tasks come on a later long-poll
        first.put(pb.PullHostTasksRequest(host=host, wait_seconds=1.0).SerializeToString())
        tasks += pb.PullHostTasksReply.FromString(next(first_replies)).tasks
    second, second_replies = stream()
    second.put(pb.PullHostTasksRequest(host=host).SerializeToString())
    with pytest.raises(grpc.RpcError) as err:
        next(second_replies)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "host 'host-a' already has a task stream open" in err.value.details()
    first.put(pb.PullHostTasksRequest(host=pb.AgentAuth(agent_id="host-b", token=b.host_token)).SerializeToString())
    with pytest.raises(grpc.RpcError) as err:
        next(first_replies)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "host 'host-a''s" in err.value.details()
    assert {t.agent_id for t in tasks} <= {"a0", "a1"}
    again = pull_tasks(stub, pb.PullHostTasksRequest(host=host, wait_seconds=0.0))  # the first ended: a new one opens
    assert not again.shutdown_reason


@pytest.mark.parametrize("case", ["garbage", "stale session", "a stranger's first message"])
def test_a_task_stream_message_the_coordinator_cannot_take_ends_the_stream_with_its_status(start_coordinator, case):
    """A malformed long-poll, one with a session the coordinator does not know, or a first message that names no
    host it knows: the stream ends with the reason, and the host's next stream is served."""
    import queue

    from fedpar.protocol.codec import SERVICE_NAME

    server = start_coordinator([np.zeros(4, np.float32)], accept_populations=True, clients_per_round=2,
                               min_available=4, rounds=1)
    stub = _stub(server)
    a = _join(stub, "host-a", ["a0", "a1"])
    host = pb.AgentAuth(agent_id="host-a", token=a.host_token)
    requests: queue.SimpleQueue = queue.SimpleQueue()
    replies = grpc.insecure_channel(server.address).stream_stream(f"/{SERVICE_NAME}/HostTaskStream")(
        iter(requests.get, None), timeout=20)
    if case != "a stranger's first message":
        requests.put(pb.PullHostTasksRequest(host=host).SerializeToString())
        assert not pb.PullHostTasksReply.FromString(next(replies)).shutdown_reason
    message, code, text = {
        "garbage": (b"\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT, "not a valid fedpar.v1.PullHostTasksRequest"),
        "stale session": (pb.PullHostTasksRequest(host=pb.AgentAuth(agent_id="host-a", token="stale")),
                          grpc.StatusCode.UNAUTHENTICATED, ""),
        "a stranger's first message": (pb.PullHostTasksRequest(host=pb.AgentAuth(agent_id="host-z", token="x")),
                                       grpc.StatusCode.UNAUTHENTICATED, ""),
    }[case]
    requests.put(message if isinstance(message, bytes) else message.SerializeToString())
    with pytest.raises(grpc.RpcError) as err:
        next(replies)
    assert err.value.code() == code and text in (err.value.details() or ""), err.value.details()
    assert not pull_tasks(stub, pb.PullHostTasksRequest(host=host, wait_seconds=0.0)).shutdown_reason


def test_a_hosts_failed_tasks_told_on_its_upload_stream_count_at_once_and_only_for_its_members(start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, clients_per_round=2,
                               min_available=2, rounds=1, deadline_seconds=60.0)
    stub = _stub(server)
    joined = _join(stub, "h", ["m0", "m1"])
    host = pb.AgentAuth(agent_id="h", token=joined.host_token)
    got: dict[str, pb.TrainTask] = {}
    end = time.monotonic() + 20
    while len(got) < 2 and time.monotonic() < end:
        got.update({t.agent_id: t.task for t in pull_tasks(stub, pb.PullHostTasksRequest(host=host, wait_seconds=1.0),
                                                           timeout=10).tasks})
    assert sorted(got) == ["m0", "m1"]
    _refused(lambda: upload_batch(stub, pb.HostUploads(host=host, failures=[
        pb.TaskFailure(agent_id="not-mine", task_id=got["m0"].task_id, reason="x")])),
        grpc.StatusCode.PERMISSION_DENIED, "'not-mine' is not a member of host 'h'")
    _refused(lambda: upload_batch(stub, pb.HostUploads(host=host, failures=[
        pb.TaskFailure(agent_id="m0", task_id=got["m0"].task_id, reason="x")] * 513)),
        grpc.StatusCode.INVALID_ARGUMENT, "513 failures in one message")
    told = upload_batch(stub, pb.HostUploads(host=host, failures=[
        pb.TaskFailure(agent_id="m0", task_id=got["m0"].task_id, reason="data raised KeyError: 'no rows'")]))
    assert list(told.results) == [] and not told.HasField("partial")
    reply = stub.UploadSmall(pb.SmallUpload(
        header=pb.UploadHeader(auth=_member(joined, "m1"), round=1, task_id=got["m1"].task_id, num_examples=10,
                               steps=1, tensors=[pb.TensorSpec(name="t0", dtype="float32", shape=list(SHAPE))],
                               total_bytes=32),
        data=np.ones(SHAPE, np.float32).tobytes()), timeout=10)
    assert reply.accepted
    assert server.wait(10)  # m0 answered (without an update): the round did not wait out its deadline for it
    (row,) = server.coordinator.metrics.read_rows()
    assert (row["status"], row["reported"], row["rejected"]) == ("ok", 1, 1), row
    assert row["training_error"] == "data raised KeyError: 'no rows'", row
