"""Raw gRPC calls of a simulation host, for tests of populations at the coordinator."""

from __future__ import annotations

import time

import grpc
import pytest

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import CoordinatorStub, channel_options, member_token


def host_stub(server) -> CoordinatorStub:
    """A stub on ``server``'s port."""
    return CoordinatorStub(grpc.insecure_channel(server.address, options=channel_options(64 << 20)))


def join_members(stub, host: str, ids, token: str = "", examples: int = 10, away=(), capabilities=None
                 ) -> pb.JoinPopulationReply:
    """Register ``ids`` as members of ``host`` (``token``: the host's session after its first call; ``away``: the
    positions of those offline). Retried, as a host retries it, while the coordinator restores its checkpoint: its port
    (and port file) answers from the moment it listens."""
    request = pb.JoinPopulationRequest(host=pb.AgentAuth(agent_id=host, token=token), member_ids="\n".join(ids),
                                       num_examples=[examples] * len(ids), away=away, capabilities=capabilities or {})
    end = time.monotonic() + 30
    while True:
        try:
            return stub.JoinPopulation(request, timeout=30)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE or "restoring" not in (err.details() or "") \
                    or time.monotonic() > end:
                raise
            time.sleep(0.05)


def member_auth(reply: pb.JoinPopulationReply, member: str) -> pb.AgentAuth:
    """The session of ``member`` of the host that got ``reply``."""
    return pb.AgentAuth(agent_id=member, token=member_token(reply.host_token, member))


def refused(call, code, text) -> None:
    """Assert ``call()`` fails with ``code`` and a message containing ``text``."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code and text in err.value.details(), err.value.details()


def upload_batch(stub, request: pb.HostUploads, timeout: float = 10) -> pb.HostUploadResults:
    """``request`` as the one message of a host's HostUploadStream: its results, or the stream's refusal raised. The
    stream is read to its end, so the host's next stream finds it closed (a host has one open at a time)."""
    replies = stub.HostUploadStream(iter([request]), timeout=timeout)
    results = next(replies)
    assert list(replies) == []
    return results


def pull_tasks(stub, request: pb.PullHostTasksRequest, timeout: float = 10) -> pb.PullHostTasksReply:
    """``request`` as the one long-poll of a host's HostTaskStream: its reply, or the stream's refusal raised (read
    to its end, as :func:`upload_batch` reads its stream)."""
    replies = stub.HostTaskStream(iter([request]), timeout=timeout)
    reply = next(replies)
    assert list(replies) == []
    return reply
