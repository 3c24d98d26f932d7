"""Every admission limit refuses with RESOURCE_EXHAUSTED (naming its option) and changes nothing."""

from __future__ import annotations

import gc
import threading
import time

import grpc
import numpy as np
import pytest

from fedpar.client.transfer import upload_messages, upload_update
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout
from fedpar.server.limits import TokenBucket

SHAPES = ((6, 4), (4,))
NAMES = ["t0", "t1"]


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def _exhausted(call, option):
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.value.code(), err.value.details())
    assert option in err.value.details(), err.value.details()


def _hold_open(server, agent, messages):
    """Start ``agent``'s upload and keep it open after its first data chunk until the returned event is set;
    returns (the call's future, that event) once the coordinator counts the upload as in progress."""
    msgs, release = list(messages), threading.Event()

    def held_open():
        yield from msgs[:2]
        release.wait(20)
        yield from msgs[2:]

    held = agent.stub.UploadUpdate.future(held_open(), timeout=30)
    for _ in range(100):
        if server.coordinator.current.slots[agent.agent_id].status == "uploading":
            break
        time.sleep(0.05)
    return held, release


def _unchanged(server, init):
    return all(a.tobytes() == b.tobytes() for a, b in zip(server.coordinator.weights, init))


def test_token_bucket_refills_at_its_rate_up_to_its_burst():
    now = [0.0]
    bucket = TokenBucket(rate=2.0, burst=4.0, clock=lambda: now[0])
    assert all(bucket.take() for _ in range(4)) and not bucket.take()
    now[0] = 1.0
    assert bucket.take(2.0) and not bucket.take(0.5)
    now[0] = 100.0
    assert bucket.take(4.0) and not bucket.take(0.1)


def test_per_agent_calls_in_flight_are_bounded(start_coordinator, agents):
    server = start_coordinator(_arrays(), min_available=5, max_calls_per_agent=2)
    (bot,) = agents(server.address, ["a"])
    polls = [bot.stub.PullTask.future(pb.PullTaskRequest(auth=bot.auth, wait_seconds=3.0), timeout=10)
             for _ in range(2)]
    time.sleep(0.5)
    _exhausted(lambda: bot.stub.Heartbeat(pb.HeartbeatRequest(auth=bot.auth), timeout=5), "--max-calls-per-agent")
    for poll in polls:
        assert poll.result().WhichOneof("kind") == "wait_seconds"
    assert bot.stub.Heartbeat(pb.HeartbeatRequest(auth=bot.auth), timeout=5).current_round == 0  # none yet


def test_upload_attempts_chunks_and_byte_rate_are_bounded(start_coordinator, agents):
    init = _arrays()
    layout = ModelLayout.of_arrays(NAMES, init)  # 112 bytes
    server = start_coordinator(init, clients_per_round=3, min_available=3, max_upload_attempts_per_round=3,
                               max_upload_chunks=3, max_upload_bytes_per_second=1.0,
                               deadline_seconds=4.0)
    tries, chunky, fast = agents(server.address, ["tries", "chunky", "fast"])
    tasks = {b.agent_id: b.task() for b in (tries, chunky, fast)}

    def stream(bot, chunk, keep=None):
        msgs = list(upload_messages(bot.auth, tasks[bot.agent_id], layout, _arrays(5), 10, 1, {}, chunk))
        return msgs if keep is None else msgs[:keep]

    # Three broken-off uploads are allowed; a fourth start is refused.
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as err:
            tries.upload(tasks["tries"], None, 0, messages=stream(tries, 64, keep=2))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _exhausted(lambda: tries.upload(tasks["tries"], _arrays(6), 10, NAMES), "--max-upload-attempts")
    # 112 bytes in 16-byte chunks is 7 chunks > 3; the same update in 64-byte chunks passes.
    _exhausted(lambda: chunky.upload(tasks["chunky"], None, 0, messages=stream(chunky, 16)), "--max-upload-chunks")
    # At 1 byte/s the burst is two models (224 bytes): 96 + 96 bytes pass, the next 64 do not.
    for _ in range(2):
        with pytest.raises(grpc.RpcError):
            fast.upload(tasks["fast"], None, 0, messages=stream(fast, 32, keep=4))
    _exhausted(lambda: fast.upload(tasks["fast"], None, 0, messages=stream(fast, 32)), "--max-upload-bytes-per-second")
    assert _unchanged(server, init)
    update = _arrays(7)
    assert chunky.upload(tasks["chunky"], update, 10, NAMES).accepted
    assert server.wait(20)
    row = server.coordinator.metrics.last
    assert (row["reported"], row["rejected"], row["late"], row["silent"]) == (1, 0, 0, 2)
    np.testing.assert_allclose(server.coordinator.weights[0], update[0], rtol=1e-6)


def test_registry_size_and_join_rate_are_bounded(start_coordinator, agents):
    server = start_coordinator(_arrays(), min_available=2, max_agents=3, max_joins_per_second=1.0)
    a, b, c = agents(server.address, ["a", "b", "c"])
    _exhausted(lambda: a.stub.Join(pb.JoinRequest(agent_id="d", num_examples=1), timeout=5), "--max-agents")
    assert a.stub.Join(pb.JoinRequest(agent_id="a", num_examples=1, replaces_token=a.auth.token),
                       timeout=5).token  # a known agent re-joins (the process that holds its session)
    b.stub.Join(pb.JoinRequest(agent_id="b", num_examples=1, replaces_token=b.auth.token), timeout=5)
    # Burst of five seconds' worth (5 joins) is now spent.
    _exhausted(lambda: a.stub.Join(pb.JoinRequest(agent_id="c", num_examples=1), timeout=5),
               "--max-joins-per-second")
    assert len(server.coordinator.registry) == 3


def test_a_full_registry_makes_room_by_forgetting_agents_that_left(start_coordinator, agents):
    server = start_coordinator(_arrays(), min_available=2, max_agents=2)
    a, b = agents(server.address, ["a", "b"])
    _exhausted(lambda: a.stub.Join(pb.JoinRequest(agent_id="c", num_examples=1), timeout=5), "--max-agents")
    b.stub.Leave(pb.LeaveRequest(auth=b.auth), timeout=5)
    assert a.stub.Join(pb.JoinRequest(agent_id="c", num_examples=1), timeout=5).token
    assert sorted(r for r in ("a", "b", "c") if server.coordinator.registry.get(r)) == ["a", "c"]


def test_a_stalled_upload_is_cut_off_at_the_round_deadline(start_coordinator, agents):
    init = _arrays()
    server = start_coordinator(init, min_available=1, clients_per_round=1, deadline_seconds=2.0,
                               max_concurrent_uploads=1)
    (bot,) = agents(server.address, ["slow"])
    task = bot.task()
    msgs = list(upload_messages(bot.auth, task, ModelLayout.of_arrays(NAMES, init), _arrays(3), 10, 1, {}, 32))

    def stalled():
        yield from msgs[:2]
        time.sleep(8)

    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        bot.upload(task, None, 0, messages=stalled(), timeout=20)
    assert err.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION)
    assert "not applied" in err.value.details()
    assert time.monotonic() - start < 6
    assert server.wait(10) and _unchanged(server, init)


def test_an_upload_abandoned_midway_frees_its_slot_and_logs_no_traceback(start_coordinator, agents, caplog):
    """An agent that cancels its upload after some chunks left the coordinator's read of its next chunk unread: asyncio
    logged 'Task exception was never retrieved' with a traceback, once per abandoned stream."""
    init = _arrays()
    server = start_coordinator(init, min_available=1, clients_per_round=1, max_concurrent_uploads=1,
                               max_upload_attempts_per_round=10)
    (bot,) = agents(server.address, ["quitter"])
    task = bot.task()
    layout = ModelLayout.of_arrays(NAMES, init)
    for _ in range(3):
        held, release = _hold_open(server, bot, upload_messages(bot.auth, task, layout, _arrays(3), 10, 1, {}, 32))
        held.cancel()
        release.set()
        for _ in range(100):  # the slot is free once the coordinator settled the abandoned upload
            if server.coordinator.current.slots["quitter"].status == "pending":
                break
            time.sleep(0.05)
    server.on_loop(gc.collect, timeout=10)  # an unread task's error is logged when it is collected
    assert bot.upload(task, _arrays(4), 10, NAMES).accepted  # the one staging slot was given back each time
    assert server.wait(10)
    unread = [r for r in caplog.records if "never retrieved" in r.getMessage() or r.exc_info]
    assert not unread, [r.getMessage() for r in unread]


def test_concurrent_rpcs_are_bounded_server_wide(start_coordinator, agents):
    init = _arrays()
    # min_available 4 with three agents: no round starts, so every long-poll waits its full three seconds.
    server = start_coordinator(init, min_available=4, max_concurrent_rpcs=8, heartbeat_seconds=3.0)
    bots = agents(server.address, ["a", "b", "c"])
    polls = [bots[i % 3].stub.PullTask.future(pb.PullTaskRequest(auth=bots[i % 3].auth, wait_seconds=3.0),
                                              timeout=10) for i in range(8)]
    time.sleep(0.5)
    _exhausted(lambda: bots[0].stub.Heartbeat(pb.HeartbeatRequest(auth=bots[0].auth), timeout=5),
               "--max-concurrent-rpcs")
    _exhausted(lambda: bots[1].stub.Join(pb.JoinRequest(agent_id="d", num_examples=1), timeout=5),
               "--max-concurrent-rpcs")
    for poll in polls:
        assert poll.result().WhichOneof("kind") == "wait_seconds"
    assert bots[0].stub.Heartbeat(pb.HeartbeatRequest(auth=bots[0].auth), timeout=5).current_round == 0
    assert server.coordinator.registry.get("d") is None and _unchanged(server, init)


def test_queued_uploads_are_bounded(start_coordinator, agents):
    init = _arrays()
    server = start_coordinator(init, clients_per_round=2, min_available=2, max_concurrent_uploads=1,
                               max_queued_uploads=1)
    a, b = agents(server.address, ["a", "b"])
    tasks = {bot.agent_id: bot.task() for bot in (a, b)}
    layout = ModelLayout.of_arrays(NAMES, init)
    update_a, update_b = _arrays(1), _arrays(2)
    held, release = _hold_open(server, a, upload_messages(a.auth, tasks["a"], layout, update_a, 10, 1, {}, 32))
    _exhausted(lambda: b.upload(tasks["b"], update_b, 30, NAMES), "--max-queued-uploads")
    assert _unchanged(server, init) and server.coordinator.current.slots["b"].status == "pending"
    release.set()
    assert held.result().accepted
    assert b.upload(tasks["b"], update_b, 30, NAMES).accepted  # the refused upload may be retried
    assert server.wait(20)
    for got, x, y in zip(server.coordinator.weights, update_a, update_b):
        np.testing.assert_allclose(got, (10 * x + 30 * y) / 40, rtol=1e-6, atol=1e-7)


def test_upload_headers_describing_more_than_max_model_bytes_are_refused(start_coordinator, agents):
    init = _arrays()  # 112 bytes
    server = start_coordinator(init, clients_per_round=1, min_available=1, max_model_bytes=200)
    (bot,) = agents(server.address, ["big"])
    task = bot.task()
    under = [np.zeros((8, 4), np.float32), np.zeros(4, np.float32)]  # 144 bytes: only the shape is wrong
    over = [np.zeros((16, 4), np.float32), np.zeros(4, np.float32)]  # 272 bytes > 200: refused before that
    with pytest.raises(grpc.RpcError) as err:
        bot.upload(task, under, 10, NAMES)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not match" in err.value.details()
    _exhausted(lambda: bot.upload(task, over, 10, NAMES), "--max-model-bytes")
    assert _unchanged(server, init) and server.coordinator.current.slots["big"].status == "pending"
    assert bot.upload(task, _arrays(3), 10, NAMES).accepted
    assert server.wait(20)


class _Counting:
    """Wraps an upload's message iterator and counts the messages gRPC has taken from it."""

    def __init__(self, messages):
        self.messages, self.taken = iter(messages), 0

    def __iter__(self):
        return self

    def __next__(self):
        message = next(self.messages)
        self.taken += 1
        return message


def test_uploads_send_their_data_only_once_admitted(start_coordinator, agents):
    def big(seed):  # 400 KB, above SMALL_UPDATE_BYTES: such uploads wait to be admitted
        return [np.random.default_rng(seed).standard_normal(100_000).astype(np.float32)]

    init = big(0)
    server = start_coordinator(init, names=["w"], clients_per_round=3, min_available=3, max_concurrent_uploads=1,
                               max_queued_uploads=2)
    a, b, c = agents(server.address, ["a", "b", "c"])
    tasks = {bot.agent_id: bot.task() for bot in (a, b, c)}
    layout = ModelLayout.of_arrays(["w"], init)
    msgs = list(upload_messages(a.auth, tasks["a"], layout, big(1), 10, 1, {}, 64 << 10))
    held, release = _hold_open(server, a, msgs)  # a's upload holds the only staging slot
    # b waits in the queue for the slot: only its header has left the agent.
    waiting = _Counting(upload_messages(b.auth, tasks["b"], layout, big(2), 30, 1, {}, 64 << 10))
    queued = threading.Thread(target=lambda: upload_update(b.stub, waiting, timeout=30))
    queued.start()
    time.sleep(0.5)
    assert waiting.taken == 1 and server.coordinator.current.slots["b"].status == "uploading"
    # c finds the queue full: refused after its header, its data never sent.
    refused = _Counting(upload_messages(c.auth, tasks["c"], layout, big(3), 60, 1, {}, 64 << 10))
    _exhausted(lambda: upload_update(c.stub, refused, timeout=30), "--max-queued-uploads")
    assert refused.taken == 1
    release.set()
    assert held.result().accepted
    queued.join(20)
    assert waiting.taken == len(msgs)  # admitted once a's upload left the slot: the whole stream went
    assert upload_update(c.stub, upload_messages(c.auth, tasks["c"], layout, big(3), 60, 1, {}, 64 << 10)).accepted
    assert server.wait(20)
    expected = [(10 * x + 30 * y + 60 * z) / 100 for x, y, z in zip(big(1), big(2), big(3))]
    for got, exp in zip(server.coordinator.weights, expected):
        np.testing.assert_allclose(got, exp, rtol=1e-6, atol=1e-7)
