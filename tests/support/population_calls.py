"""Raw gRPC calls of a simulation host, for tests of populations at the coordinator."""

from __future__ import annotations

import grpc
import pytest

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.messages import CoordinatorStub, channel_options


def host_stub(server) -> CoordinatorStub:
    """A stub on ``server``'s port."""
    return CoordinatorStub(grpc.insecure_channel(server.address, options=channel_options(64 << 20)))


def join_members(stub, host: str, ids, token: str = "", examples: int = 10) -> pb.JoinPopulationReply:
    """Register ``ids`` as members of ``host`` (``token``: the host's session after its first call)."""
    members = [pb.PopulationMember(agent_id=i, num_examples=examples) for i in ids]
    return stub.JoinPopulation(pb.JoinPopulationRequest(host=pb.AgentAuth(agent_id=host, token=token),
                                                        members=members), timeout=30)


def refused(call, code, text) -> None:
    """Assert ``call()`` fails with ``code`` and a message containing ``text``."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code and text in err.value.details(), err.value.details()
