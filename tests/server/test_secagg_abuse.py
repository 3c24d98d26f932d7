"""Secure aggregation under abuse, over real gRPC on 127.0.0.1: an agent facing a coordinator that sends garbage
settings, key lists and share bundles, and a coordinator facing agents that send malformed or out-of-order stage
messages."""

from __future__ import annotations

import json
import threading
import time
import tracemalloc
from concurrent import futures

import grpc
import pytest

from fedpar.client.secure_upload import SecureSession, SecureUpload
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import SERVICE_NAME, CoordinatorStub, ModelLayout, channel_options, one_line

VECTOR = 10
LAYOUT = ModelLayout([("w", "float32", (VECTOR,))])


class SecAggStandIn:
    """A coordinator that answers SecAggExchange with ``answer(request)`` (a SecAggReply or raw bytes)."""

    def __init__(self, answer):
        self.answer = answer
        self.requests: list[pb.SecAggRequest] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(4), options=channel_options(64 << 20))
        handler = grpc.unary_unary_rpc_method_handler(self._exchange, pb.SecAggRequest.FromString,
                                                      lambda m: m if isinstance(m, bytes) else m.SerializeToString())
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, {"SecAggExchange": handler}),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()
        self.channel = grpc.insecure_channel(self.address)

    def _exchange(self, request, context):
        self.requests.append(request)
        return self.answer(request)

    def session(self, poll_seconds: float = 1.0, stage_timeout: float = 3.0) -> SecureSession:
        """A member's session talking to this stand-in."""
        task = pb.TrainTask(round=1, task_id="t1", deadline_seconds=30)
        return SecureSession(CoordinatorStub(self.channel), pb.AgentAuth(agent_id="me", token="tok"), task,
                             poll_seconds, stage_timeout)

    def stop(self) -> None:
        self.channel.close()
        self.server.stop(0)


@pytest.fixture
def stand_in():
    made = []

    def _make(answer):
        made.append(SecAggStandIn(answer))
        return made[-1]
    yield _make
    for s in made:
        s.stop()


def _params(participants, neighbours, threshold, **over) -> str:
    return json.dumps({"round_id": 1, "participants": sorted(participants), "vector_length": VECTOR, "clip": 1.0,
                       "max_weight": 1, "neighbours": neighbours, "threshold": threshold, "graph_seed": "ab" * 32,
                       **over})


def _begin(session: SecureSession) -> list[str]:
    """Run the key exchange as a member does; what it noted (each refusal must be one printable line)."""
    noted = []
    mode = SecureUpload(session, LAYOUT, 1 << 16, time.monotonic() + 30,
                        lambda what, err: noted.append(f"{what}: {err}"))
    assert mode.begin() is False
    assert len(noted) == 1 and one_line(noted[0]) == noted[0], noted
    return noted


@pytest.mark.parametrize("text", [
    _params(["me", "b", "c"], 2, 2, round_id=1e400),  # json reads inf: int() raised OverflowError
    _params(["me", "b", "c"], 2, 2, max_weight=1e400),
    _params([["me"], ["b"]], 1, 2),  # unhashable participants: validate() raised TypeError
    "[" * 100_000 + "]" * 100_000,  # RecursionError
])
def test_settings_that_do_not_parse_are_refused_in_one_line(stand_in, text):
    coordinator = stand_in(lambda r: pb.SecAggReply(params_json=text))
    noted = _begin(coordinator.session())
    assert "malformed secure-aggregation settings" in noted[0], noted
    assert [r.stage for r in coordinator.requests] == [pb.SECAGG_SETUP]  # nothing advertised under such settings


def test_settings_naming_a_huge_neighbourhood_cost_the_agent_its_own_neighbours_only(stand_in):
    # 4000 participants, each a neighbour of 3998: the agent built all 4000 neighbour sets (1.5 GB, seconds of
    # CPU; 8 GB at the 10,000 participants the settings may name) from a 40 KB reply.
    people = ["me"] + [f"p{i:04d}" for i in range(3999)]
    text = _params(people, 3998, 2000)

    def answer(request):
        if request.stage == pb.SECAGG_SETUP:
            return pb.SecAggReply(params_json=text)
        return pb.SecAggReply(keys=pb.SecAggKeys())  # nobody else advertised
    coordinator = stand_in(answer)
    tracemalloc.start()
    try:
        start = time.monotonic()
        noted = _begin(coordinator.session())
        took = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "only 0 neighbours advertised keys" in noted[0], noted
    assert peak < 50 << 20 and took < 5, (peak, took)


def test_a_coordinator_answering_every_poll_at_once_is_not_polled_in_a_loop(stand_in):
    # An honest coordinator answers "wait" only after the wait the agent asked for; this one answers at once, for
    # ever: the agent asked again as fast as gRPC allowed, a core spinning until the stage timed out.
    people = ["me", "b", "c"]

    def answer(request):
        if request.stage == pb.SECAGG_SETUP:
            return pb.SecAggReply(params_json=_params(people, 2, 2))
        return pb.SecAggReply(wait_seconds=0.0)
    coordinator = stand_in(answer)
    start = time.monotonic()
    noted = _begin(coordinator.session(poll_seconds=0.5, stage_timeout=2.0))
    assert "no secure-aggregation broadcast for stage SECAGG_ADVERTISE" in noted[0], noted
    polls = [r for r in coordinator.requests if r.stage == pb.SECAGG_ADVERTISE]
    assert 2 <= len(polls) <= 8 and time.monotonic() - start < 5, len(polls)
