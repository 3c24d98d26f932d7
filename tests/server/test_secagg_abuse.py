"""Secure aggregation under abuse, over real gRPC on 127.0.0.1: an agent facing a coordinator that sends garbage
settings, key lists and share bundles, and a coordinator facing agents that send malformed or out-of-order stage
messages."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import tracemalloc
from concurrent import futures

import grpc
import numpy as np
import pytest

from fedpar.client import dataplane
from fedpar.client.secure_upload import MASKED_TENSOR, SecureSession, SecureUpload, flat_update
from fedpar.client.transfer import upload_messages
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import SERVICE_NAME, CoordinatorStub, ModelLayout, channel_options, one_line
from fedpar.secagg import wire

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
    mode = SecureUpload(session, LAYOUT, 1 << 16, lambda what, err: noted.append(f"{what}: {err}"))
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


@pytest.mark.parametrize("neighbours, said", [(3998, "neighbours k=3998 is above the 128 a client takes"),
                                               (128, "only 0 neighbours advertised keys")])
def test_settings_naming_a_huge_neighbourhood_cost_the_agent_its_own_neighbours_only(stand_in, neighbours, said):
    # 4000 participants, each a neighbour of 3998: the agent built all 4000 neighbour sets (1.5 GB, seconds of
    # CPU; 8 GB at the 10,000 participants the settings may name) from a 40 KB reply, and with that many keys
    # advertised would compute k squared Shamir steps (~20 s at k = 10,000): such a k is refused; the most it takes
    # costs it its own neighbours only.
    people = ["me"] + [f"p{i:04d}" for i in range(3999)]
    text = _params(people, neighbours, neighbours // 2 + 1)

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
    assert said in noted[0], noted
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



def _masked_upload(bot, task, vector, via_data_plane: bool, address: str):
    """Upload ``vector`` (int32) as this agent's masked input, over the data plane or the gRPC stream."""
    layout = ModelLayout([(MASKED_TENSOR, vector.dtype.name, vector.shape)])
    if via_data_plane:
        return dataplane.upload(dataplane.DataPlaneTarget(address, task), bot.auth, task, layout, [vector], 1, 0, {},
                                10)
    return bot.upload(task, None, 0, messages=list(upload_messages(bot.auth, task, layout, [vector], 1, 0, {},
                                                                    bot.max_chunk)))


def _refused_upload(call, code: grpc.StatusCode, fragment: str) -> None:
    try:
        call()
    except grpc.RpcError as err:
        assert err.code() == code and fragment in err.details(), (err.code(), err.details())
        return
    except dataplane.DataPlaneRefused as err:
        assert err.code == code.value[0] and fragment in err.message, dataplane.refusal_text(err)
        return
    raise AssertionError("a hostile masked upload was accepted")


def test_masked_uploads_out_of_turn_misshapen_or_twice_never_reach_the_sum(start_coordinator, agents):
    ids, counts = ["a", "b", "c"], {"a": 10, "b": 30, "c": 60}
    rng = np.random.default_rng(0)
    init = [rng.standard_normal((6, 4)).astype(np.float32)]
    server = start_coordinator(init, secure_aggregation=True, data_plane=True, clients_per_round=3, min_available=3,
                               deadline_seconds=60, secagg_stage_seconds=20)
    bots = dict(zip(ids, agents(server.address, ids)))
    tasks = {i: bots[i].task() for i in ids}
    assert all(t.data_port for t in tasks.values())
    length = init[0].size + 1
    junk = rng.integers(-2**31, 2**31, length, dtype=np.int64).astype(np.int32)
    address = server.address
    for via in (False, True):  # before the key stages: nobody has shared keys yet
        _refused_upload(lambda: _masked_upload(bots["a"], tasks["a"], junk, via, address),
                        grpc.StatusCode.FAILED_PRECONDITION, "shared its keys")

    sessions = {i: SecureSession(bots[i].stub, bots[i].auth, tasks[i], 0.5, 30) for i in ids}
    with futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda i: sessions[i].begin(init[0].size), ids))
    locals_ = {i: [(init[0] + rng.uniform(-0.5, 0.5, init[0].shape)).astype(np.float32)] for i in ids}
    masked = {}
    for i in ids:
        routed = sessions[i]._expect(sessions[i]._call(pb.SECAGG_SHARE), "ciphertexts")
        masked[i] = sessions[i].client.masked_input(wire.routed_shares_from_pb(i, routed),
                                                    flat_update(locals_[i], init), counts[i]).vector.view(np.int32)
    for via in (False, True):  # one value short, one too many, the wrong dtype
        for bad in (masked["a"][:-1], np.append(masked["a"], 7), masked["a"].view(np.float32)):
            _refused_upload(lambda: _masked_upload(bots["a"], tasks["a"], bad, via, address),
                            grpc.StatusCode.INVALID_ARGUMENT, "")
    assert _masked_upload(bots["a"], tasks["a"], masked["a"], True, address).accepted  # over the data plane
    for via in (False, True):
        _refused_upload(lambda: _masked_upload(bots["a"], tasks["a"], junk, via, address),
                        grpc.StatusCode.ALREADY_EXISTS, "")
    assert _masked_upload(bots["b"], tasks["b"], masked["b"], False, address).accepted
    assert _masked_upload(bots["c"], tasks["c"], masked["c"], False, address).accepted
    with futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda i: sessions[i].unmask(), ids))
    assert server.wait(30)
    row = server.coordinator.metrics.last
    assert (row["status"], row["secagg_survivors"]) == ("ok", 3), row
    expected = sum(counts[i] * locals_[i][0].astype(np.float64) for i in ids) / sum(counts.values())
    np.testing.assert_allclose(server.coordinator.weights[0], expected, rtol=0, atol=1e-5)


def test_each_stage_message_does_not_wake_every_long_poll_of_the_cohort():
    # Every advert woke every agent's long-poll to re-check a condition only a stage's close changes: n^2 wakeups,
    # 2 s of the coordinator's loop for 1000 agents in each stage (8 s for 2000, minutes at the 10,000 allowed).
    from fedpar.aggregation import FedAvg
    from fedpar.secagg import keys
    from fedpar.server.secure_round import SecureRound

    ids = [f"a{i:04d}" for i in range(1000)]
    adverts = {i: pb.SecAggPublicKeys(c_public=keys.public_bytes(keys.generate_private_key()),
                                      s_public=keys.public_bytes(keys.generate_private_key())) for i in ids}

    async def stage_one():
        secure = SecureRound(1, ids, [np.zeros(4, np.float32)], 1.0, 1, 30.0, FedAvg(), None)
        polls = [asyncio.ensure_future(secure.exchange(i, pb.SecAggRequest(stage=pb.SECAGG_ADVERTISE,
                                                                            wait_seconds=30)))
                 for i in ids]
        await asyncio.sleep(0)
        started = time.thread_time()
        for i in ids:
            reply = await secure.exchange(i, pb.SecAggRequest(stage=pb.SECAGG_ADVERTISE, public_keys=adverts[i]))
            assert reply.WhichOneof("body") == "wait_seconds"
            await asyncio.sleep(0)  # the pollers run between messages, as they do between calls
        took = time.thread_time() - started
        secure.server.close_advertising()
        secure._notify(stage=True)
        replies = await asyncio.gather(*polls)
        assert all(len(r.keys.items) == secure.params.neighbours for r in replies)
        return took
    took = asyncio.run(stage_one())
    assert took < 1.0, took
