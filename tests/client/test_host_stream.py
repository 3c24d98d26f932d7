"""A host's kept streams (client/host_stream.py): a reply that does not come in time ends the stream with
DEADLINE_EXCEEDED, and the next message opens another; a message on a stream the coordinator ends goes again on a new
one, once."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from fedpar.client.host_stream import CallRefused, KeptStream
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import SERVICE_NAME, CoordinatorStub

# each of the host's two streams, with its message types, served by a stand-in coordinator
STREAMS = {"HostUploadStream": (pb.HostUploads, pb.HostUploadResults),
           "HostTaskStream": (pb.PullHostTasksRequest, pb.PullHostTasksReply)}


def _serve(method: str, handler):
    """A gRPC server on loopback answering ``method`` with ``handler`` (a stand-in for a coordinator)."""
    request, reply = STREAMS[method]
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {
        method: grpc.stream_stream_rpc_method_handler(handler, request.FromString, reply.SerializeToString)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


@pytest.mark.parametrize("method", list(STREAMS))
def test_a_reply_that_does_not_come_in_time_ends_the_stream_and_the_next_message_opens_another(method):
    """A coordinator that takes a message and never answers (a stuck one)."""
    opened, release = [], threading.Event()

    def stuck(request_iterator, context):
        opened.append(next(request_iterator))
        release.wait(10)
        return iter(())

    server, stub = _serve(method, stuck)
    stream = KeptStream(getattr(stub, method), "test stream")
    try:
        for _ in range(2):
            start = time.monotonic()
            with pytest.raises(CallRefused) as err:
                stream.send(STREAMS[method][0](host=pb.AgentAuth(agent_id="host-a")), 0.3)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "no reply within 0.3 s on the test stream" in err.value.details()
            assert 0.3 <= time.monotonic() - start < 3
        assert len(opened) == 2  # the second message went on a new stream
    finally:
        stream.close()
        release.set()
        server.stop(0)


def test_replies_come_in_order_on_one_stream_and_a_message_the_coordinator_ended_it_on_goes_on_a_new_one():
    """Each message its own reply, all on the stream opened at the first; a message the coordinator ended the stream
    on without answering (a service's coordinator does when the next one takes the calls) is sent again, once, on
    a new stream; a coordinator that ends that one too is a refusal to retry (UNAVAILABLE)."""
    streams = []

    def answer_two(request_iterator, context):
        streams.append(0)
        for n, request in zip(range(2), request_iterator):
            yield pb.PullHostTasksReply(shutdown_reason=f"{request.host.agent_id} {n}")

    server, stub = _serve("HostTaskStream", answer_two)
    stream = KeptStream(stub.HostTaskStream, "task stream")
    try:
        ask = lambda who: stream.send(pb.PullHostTasksRequest(host=pb.AgentAuth(agent_id=who)), 5)  # noqa: E731
        assert [ask(who).shutdown_reason for who in "abcde"] == ["a 0", "b 1", "c 0", "d 1", "e 0"]
        assert len(streams) == 3
    finally:
        stream.close()
        server.stop(0)

    def answer_none(request_iterator, context):
        streams.append(0)
        next(request_iterator)
        return iter(())

    streams.clear()
    server, stub = _serve("HostTaskStream", answer_none)
    stream = KeptStream(stub.HostTaskStream, "task stream")
    try:
        with pytest.raises(CallRefused) as err:
            stream.send(pb.PullHostTasksRequest(host=pb.AgentAuth(agent_id="a")), 5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the coordinator ended the task stream" in err.value.details()
        assert len(streams) == 2
    finally:
        stream.close()
        server.stop(0)
