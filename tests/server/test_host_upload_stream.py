"""A host's batches on its one HostUploadStream: each message is taken with every check (a valid
partial is folded, a bad one refused with its reason and nothing of it counted), and a message the coordinator cannot
take (bytes that do not parse, over the size limit, another host's, a stale session) ends the stream with a clear
status, touching nothing. Real coordinator, real gRPC over loopback."""

from __future__ import annotations

import queue
import time

import grpc
import numpy as np
import pytest

from fedpar.client.host_partial import HostSum
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import SERVICE_NAME, ModelLayout
from support.population_calls import host_stub, join_members, pull_tasks, upload_batch

SHAPE = (8,)
LAYOUT = ModelLayout([("t0", "float32", SHAPE)])


def _tasks(stub, host: str, reply, want: int) -> dict[str, pb.TrainTask]:
    tasks: dict[str, pb.TrainTask] = {}
    end = time.monotonic() + 20
    while len(tasks) < want and time.monotonic() < end:
        tasks.update({t.agent_id: t.task for t in pull_tasks(stub, pb.PullHostTasksRequest(
            host=pb.AgentAuth(agent_id=host, token=reply.host_token), wait_seconds=0.2), timeout=10).tasks})
    assert len(tasks) == want, tasks.keys()
    return tasks


def _partial(tasks, members, value: float) -> pb.HostPartial:
    partial = HostSum(LAYOUT, next(iter(tasks.values())).round, [])
    for m in members:
        partial.add(m, tasks[m].task_id, [np.full(SHAPE, value, np.float32)], 10, 1, {}, (10, 1))
    return partial.message()


def _stream(channel):
    """A raw HostUploadStream: put serialized HostUploads (or any bytes) on the queue, read the results."""
    requests: queue.SimpleQueue = queue.SimpleQueue()
    replies = channel.stream_stream(f"/{SERVICE_NAME}/HostUploadStream")(iter(requests.get, None), timeout=20)
    return requests, replies


@pytest.fixture
def one_round(start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, clients_per_round=4,
                               overselect=1.0, min_available=4, rounds=1, max_chunk_bytes=4096)
    stub = host_stub(server)
    a = join_members(stub, "host-a", ["a0", "a1", "a2"])
    b = join_members(stub, "host-b", ["b0"])
    tasks = _tasks(stub, "host-a", a, 3)
    return server, stub, a, b, tasks


def test_a_valid_partial_on_the_stream_is_folded_and_a_bad_one_is_refused_with_nothing_counted(one_round):
    server, stub, a, b, tasks = one_round
    requests, replies = _stream(grpc.insecure_channel(server.address))
    host = pb.AgentAuth(agent_id="host-a", token=a.host_token)
    bad = _partial(tasks, ["a0", "a1"], 1.0)
    bad.data = np.full(SHAPE, np.nan, np.float32).tobytes()
    requests.put(pb.HostUploads(host=host, partial=bad).SerializeToString())
    refused = pb.HostUploadResults.FromString(next(replies)).partial
    assert not refused.accepted and "contains NaN or Inf" in refused.message, refused.message
    state = server.coordinator.current
    assert state.accepted == 0 and server.coordinator.strategy.folded == 0
    requests.put(pb.HostUploads(host=host, partial=_partial(tasks, ["a0", "a1"], 2.0)).SerializeToString())
    good = pb.HostUploadResults.FromString(next(replies)).partial
    assert good.accepted and "2 updates accepted" in good.message, good.message
    requests.put(pb.HostUploads(host=host, partial=_partial(tasks, ["a2"], 2.0)).SerializeToString())
    assert pb.HostUploadResults.FromString(next(replies)).partial.accepted  # the same stream, again
    requests.put(None)
    assert state.accepted == 3


@pytest.mark.parametrize("case", ["garbage", "oversized", "other host", "stale session"])
def test_a_message_the_coordinator_cannot_take_ends_the_stream_with_its_status_and_touches_nothing(one_round, case):
    server, stub, a, b, tasks = one_round
    requests, replies = _stream(grpc.insecure_channel(server.address))
    host = pb.AgentAuth(agent_id="host-a", token=a.host_token)
    requests.put(pb.HostUploads(host=host).SerializeToString())  # an empty batch: the stream is the host's now
    assert pb.HostUploadResults.FromString(next(replies)) == pb.HostUploadResults()
    message, code, text = {
        "garbage": (b"\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT, "not a valid fedpar.v1.HostUploads"),
        "oversized": (pb.HostUploads(host=host, partial=pb.HostPartial(data=b"\x00" * 100_000)).SerializeToString(),
                      grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
        "other host": (pb.HostUploads(host=pb.AgentAuth(agent_id="host-b", token=b.host_token),
                                      partial=_partial(tasks, ["a0"], 1.0)).SerializeToString(),
                       grpc.StatusCode.PERMISSION_DENIED, "this stream is host 'host-a''s, not 'host-b''s"),
        "stale session": (pb.HostUploads(host=pb.AgentAuth(agent_id="host-a", token="stale"),
                                         partial=_partial(tasks, ["a0"], 1.0)).SerializeToString(),
                          grpc.StatusCode.UNAUTHENTICATED, ""),
    }[case]
    requests.put(message)
    with pytest.raises(grpc.RpcError) as err:
        next(replies)
    assert err.value.code() == code and text in (err.value.details() or ""), err.value.details()
    assert server.coordinator.current.accepted == 0 and server.coordinator.strategy.folded == 0
    # the coordinator goes on: the same partial on the host's next stream is taken
    results = upload_batch(stub, pb.HostUploads(host=host, partial=_partial(tasks, ["a0"], 1.0)))
    assert results.partial.accepted, results.partial.message


def test_a_coordinator_without_the_stream_refuses_the_hosts_updates_and_no_other_call_is_tried():
    """The stream is the host's one upload path: a gRPC server that serves no HostUploadStream (here one that serves
    nothing of fedpar's) refuses an awaited update to its seat with UNIMPLEMENTED, and a background one is counted
    as refused; nothing falls back to another call."""
    from concurrent import futures

    from fedpar.client.host_uploads import HostUploads
    from fedpar.client.transfer import SmallUpdate
    from fedpar.protocol.codec import CoordinatorStub

    methods = []

    class Recording(grpc.GenericRpcHandler):
        def service(self, handler_call_details):
            methods.append(handler_call_details.method)
            return None  # UNIMPLEMENTED

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((Recording(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        stub = CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        uploads = HostUploads(stub, pb.AgentAuth(agent_id="host-a"), max_bytes=1 << 20)
        update = SmallUpdate(pb.UploadHeader(task_id="t"), ModelLayout([("t", "uint8", (8,))]), [np.zeros(8, np.uint8)])
        try:
            with pytest.raises(grpc.RpcError) as err:
                uploads.send(stub, update, 10.0)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            uploads.send_later(stub, update, 10.0)
        finally:
            uploads.close()
        assert uploads.refused_in_background == 1
        assert methods == [f"/{SERVICE_NAME}/HostUploadStream"] * 2  # a new stream per batch after a failure
    finally:
        server.stop(0)


def test_a_stream_that_sends_nothing_is_a_strangers_and_is_let_go_at_the_header_deadline(start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, upload_header_seconds=0.5)
    requests, replies = _stream(grpc.insecure_channel(server.address))
    with pytest.raises(grpc.RpcError) as err:
        next(replies)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "no HostUploads within 0.5 s of opening the stream" in err.value.details()
    requests.put(None)


def test_a_host_has_one_upload_stream_open_a_second_is_refused_until_the_first_ends(one_round):
    """Each open stream holds one of the coordinator's --max-concurrent-rpcs places for its life: a host gets one,
    not one per --max-calls-per-agent."""
    server, stub, a, b, tasks = one_round
    channel = grpc.insecure_channel(server.address)
    host = pb.AgentAuth(agent_id="host-a", token=a.host_token)
    first, first_replies = _stream(channel)
    first.put(pb.HostUploads(host=host).SerializeToString())
    assert pb.HostUploadResults.FromString(next(first_replies)) == pb.HostUploadResults()
    second, second_replies = _stream(channel)
    second.put(pb.HostUploads(host=host, partial=_partial(tasks, ["a0"], 1.0)).SerializeToString())
    with pytest.raises(grpc.RpcError) as err:
        next(second_replies)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "host 'host-a' already has an upload stream open" in err.value.details()
    assert server.coordinator.current.accepted == 0  # the refused stream's partial touched nothing
    other, other_replies = _stream(channel)  # another host's stream is its own
    other.put(pb.HostUploads(host=pb.AgentAuth(agent_id="host-b", token=b.host_token)).SerializeToString())
    assert pb.HostUploadResults.FromString(next(other_replies)) == pb.HostUploadResults()
    first.put(pb.HostUploads(host=host, partial=_partial(tasks, ["a0"], 1.0)).SerializeToString())
    assert pb.HostUploadResults.FromString(next(first_replies)).partial.accepted  # the open one goes on
    first.put(None)
    assert list(first_replies) == []  # ended: the host may open its next one
    results = upload_batch(stub, pb.HostUploads(host=host, partial=_partial(tasks, ["a1"], 1.0)))
    assert results.partial.accepted, results.partial.message
    other.put(None)
