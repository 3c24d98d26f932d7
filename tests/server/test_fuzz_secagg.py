"""Fuzz SecAggExchange on a secure coordinator, stage by stage, between the honest agents' own messages.

Five honest agents walk one secure round step by step; before each step completes a stage, hypothesis
sends malformed protobufs and hostile stage messages (wrong stage or round, bad or low-order keys,
duplicates, share lists for unknown agents or too long). Each must get a clear refusal, the coordinator
must keep serving with the model unchanged, and the round must then finish as exact FedAvg of the
honest updates: nothing hostile reached the sum.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedpar.client.secure_upload import MASKED_TENSOR, flat_update
from fedpar.client.transfer import upload_messages
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import SERVICE_NAME, ModelLayout, encode_varint
from fedpar.secagg import keys, wire
from fedpar.secagg.client_protocol import SecAggClient
from fedpar.secagg.messages import SHARE_CIPHERTEXT_BYTES
from fedpar.secagg.params import RoundParams
from fedpar.secagg.shamir import SHARE_BYTES
from fedpar.secagg.wire import MAX_ITEMS

IDS = ["a", "b", "c", "d", "e"]
COUNTS = {"a": 10, "b": 25, "c": 65, "d": 40, "e": 90}
SHAPES = ((6, 4), (4,))
NAMES = ["t0", "t1"]
CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED,
         grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS}
HARMLESS_REPLIES = {"wait_seconds", "params_json", "keys", "ciphertexts", "survivors"}  # reads, never writes
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
LOW_ORDER = [bytes(32), (1).to_bytes(32, "little")] + [bytes.fromhex(h) for h in (
    "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800",
    "5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157",
    "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f")]


def _arrays(seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def _local(init, seed):
    rng = np.random.default_rng(seed)
    return [(w + rng.uniform(-0.5, 0.5, w.shape)).astype(np.float32) for w in init]


class Round:
    """A secure coordinator in round 1 and its five honest agents, driven one step at a time."""

    def __init__(self, server, bots):
        self.server, self.init = server, server.coordinator.weights
        self.bots = {b.agent_id: b for b in bots}
        self.tasks = {i: b.task() for i, b in self.bots.items()}
        self.raw = bots[0].channel.unary_unary(f"/{SERVICE_NAME}/SecAggExchange",
                                               request_serializer=lambda b: b, response_deserializer=lambda b: b)
        self.clients = {}
        for i in IDS:
            params = RoundParams.from_json(self.call(i, pb.SECAGG_SETUP).params_json)
            self.clients[i] = SecAggClient(params, i)
        self.adverts = {i: wire.advertise_to_pb(c.advertise()) for i, c in self.clients.items()}
        self.outgoing, self.unmasks = {}, {}  # each agent's stage-2 and stage-4 messages, once made

    def request(self, agent: str, stage: int, wait: float = 0.0, **kw) -> pb.SecAggRequest:
        """A request of ``agent`` for its own task (fields in ``kw`` override)."""
        base = dict(auth=self.bots[agent].auth, round=self.tasks[agent].round, task_id=self.tasks[agent].task_id,
                    stage=stage, wait_seconds=wait)
        return pb.SecAggRequest(**{**base, **kw})

    def call(self, agent: str, stage: int, wait: float = 0.0, **kw) -> pb.SecAggReply:
        """One honest call."""
        return self.bots[agent].stub.SecAggExchange(self.request(agent, stage, wait, **kw), timeout=wait + 10)

    def refused(self, raw: bytes, ok_allowed: bool = False) -> None:
        """``raw`` must be refused with a clear status (or, if allowed, get a read-only reply)."""
        try:
            reply = pb.SecAggReply.FromString(self.raw(raw, timeout=10))
        except grpc.RpcError as err:
            assert err.code() in CLEAR, (err.code(), err.details())
            assert err.details(), "a refusal must say why"
            return
        assert ok_allowed and reply.WhichOneof("body") in HARMLESS_REPLIES, f"hostile message accepted: {reply}"

    def odd_waits(self, stage: int) -> None:
        """Polls with absurd wait_seconds come back at once (a read or a clear refusal), never hang."""
        for wait in (float("nan"), -1.0, float("-inf"), -1e308, 5e-324):
            started = time.monotonic()
            self.refused(self.request(IDS[-1], stage, wait=wait).SerializeToString(), ok_allowed=True)
            assert time.monotonic() - started < 2.0, wait

    def alive(self, stage: str) -> None:
        """The coordinator serves, its round is open in ``stage``, and the model has not moved."""
        assert self.server.error is None and not self.server._finished.is_set()
        state, secure = self.server.coordinator.current, self.server.coordinator.secure
        assert state.round_id == 1 and secure.failure is None and secure.server.stage == stage
        assert all(a.tobytes() == b.tobytes() for a, b in zip(self.server.coordinator.weights, self.init))
        assert self.call("a", pb.SECAGG_SETUP).WhichOneof("body") == "params_json"


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    """One protobuf field with an arbitrary wire type (so types can be wrong on purpose)."""
    key = encode_varint((number << 3) | wire_type)
    if wire_type == 0:
        return key + encode_varint(int.from_bytes(payload[:9].ljust(1, b"\0"), "little") % (1 << 64))
    if wire_type in (1, 5):
        size = 8 if wire_type == 1 else 4
        return key + payload[:size].ljust(size, b"\0")
    return key + encode_varint(len(payload)) + payload


mangled = st.one_of(st.binary(max_size=300),
                    st.lists(st.tuples(st.integers(1, 12), st.sampled_from([0, 1, 2, 5]), st.binary(max_size=40)),
                             max_size=6).map(lambda fields: b"".join(_field(*f) for f in fields)))
cuts = st.integers(0, 1 << 16)
blobs = st.binary(max_size=80)


def _mutations(rnd: Round, valid: bytes, cut: int, flip: int):
    """A truncated and a bit-flipped copy of a (refused) valid request."""
    flipped = bytearray(valid)
    flipped[flip % len(flipped)] ^= 0x5A
    return [valid[:cut % (len(valid) + 1)], bytes(flipped)]


def _fuzz(rnd: Round, hostile, duplicate):
    """Raw bytes, then ``hostile(draw)`` requests and mutated copies of ``duplicate(draw)`` requests."""
    @FUZZ
    @given(body=mangled, pick=st.integers(0, 10_000), blob=blobs, cut=cuts, flip=cuts, n=st.integers(0, 40))
    def run(body, pick, blob, cut, flip, n):
        rnd.refused(body, ok_allowed=True)  # a random request that parses is a read (or refused)
        rnd.refused(hostile(pick, blob, n).SerializeToString())
        for raw in _mutations(rnd, duplicate(pick).SerializeToString(), cut, flip):
            rnd.refused(raw, ok_allowed=True)
    run()


def _common(rnd: Round, agent: str, pick: int, blob: bytes, stage_now: int):
    """Hostile messages that are wrong in any stage: wrong round/task/stage, bodies in the wrong place."""
    choices = [
        lambda: rnd.request(agent, stage_now, round=1 + 1 + pick),
        lambda: rnd.request(agent, stage_now, round=0),
        lambda: rnd.request(agent, stage_now, task_id=blob.hex()[:16] or "x"),
        lambda: rnd.request(agent, pb.SECAGG_SETUP, public_keys=pb.SecAggPublicKeys(c_public=blob)),
        lambda: rnd.request(agent, pb.SECAGG_MASKED, ciphertexts=pb.SecAggCiphertexts()),
        lambda: rnd.request(agent, 5 + pick % 100, unmask_shares=pb.SecAggUnmaskShares()),
        lambda: rnd.request(agent, 5 + pick % 100),
        lambda: rnd.request(agent, pb.SECAGG_UNMASK),
        lambda: rnd.request(agent, pb.SECAGG_ADVERTISE, ciphertexts=pb.SecAggCiphertexts()),
        lambda: rnd.request(agent, stage_now, auth=pb.AgentAuth(agent_id=agent, token=blob.hex())),
        lambda: rnd.request(agent, pb.SECAGG_UNMASK, unmask_shares=pb.SecAggUnmaskShares(
            self_mask_shares=[pb.SecAggShare(owner="a", share=blob)] * 2)),
        lambda: rnd.request(agent, pb.SECAGG_UNMASK, unmask_shares=pb.SecAggUnmaskShares(
            key_shares=[pb.SecAggShare(owner=f"x{k}", share=b"") for k in range(MAX_ITEMS + 1)])),
        lambda: rnd.request(agent, pb.SECAGG_SHARE, ciphertexts=pb.SecAggCiphertexts(
            items=[pb.SecAggCiphertext(peer=f"x{k}") for k in range(MAX_ITEMS + 1)])),
    ]
    return choices[pick % len(choices)]()


def _bad_keys(rnd: Round, agent: str, pick: int, blob: bytes, n: int) -> pb.SecAggPublicKeys:
    """Public keys of ``agent`` that must be refused whatever the stage: each has a defect."""
    good = rnd.adverts[agent]
    other = rnd.adverts[IDS[(IDS.index(agent) + 1) % len(IDS)]]
    length = n if n != keys.KEY_BYTES else n + 1
    low = LOW_ORDER[pick % len(LOW_ORDER)]
    defects = [
        pb.SecAggPublicKeys(c_public=blob[:length].ljust(length, b"\1"), s_public=good.s_public),
        pb.SecAggPublicKeys(c_public=good.c_public, s_public=blob[:length].ljust(length, b"\2")),
        pb.SecAggPublicKeys(c_public=low, s_public=good.s_public),
        pb.SecAggPublicKeys(c_public=good.c_public, s_public=low),
        pb.SecAggPublicKeys(c_public=good.c_public, s_public=good.c_public),
        pb.SecAggPublicKeys(c_public=other.c_public, s_public=good.s_public),
        pb.SecAggPublicKeys(agent_id=other.agent_id, c_public=good.c_public, s_public=good.s_public),
    ]
    return defects[pick % len(defects)]


def _bad_shares(rnd: Round, agent: str, pick: int, blob: bytes, n: int) -> pb.SecAggCiphertexts:
    """Share lists of ``agent`` that each break a rule: unknown, missing, duplicate, self, wrong length, too many."""
    good = rnd.outgoing[agent]
    peers = sorted(good)
    ct = lambda p: pb.SecAggCiphertext(peer=p, ciphertext=good[p])  # noqa: E731
    wrong_len = n if n != SHARE_CIPHERTEXT_BYTES else n + 1
    defects = [
        [ct(p) for p in peers] + [pb.SecAggCiphertext(peer=f"stranger{pick}", ciphertext=good[peers[0]])],
        [ct(p) for p in peers[1:]],
        [ct(p) for p in peers] + [ct(peers[pick % len(peers)])],
        [ct(p) for p in peers] + [pb.SecAggCiphertext(peer=agent, ciphertext=good[peers[0]])],
        [ct(p) for p in peers[1:]] + [pb.SecAggCiphertext(peer=peers[0], ciphertext=blob[:wrong_len])],
        [pb.SecAggCiphertext(peer=f"p{k}", ciphertext=b"") for k in range(MAX_ITEMS + 1 + n)],
    ]
    return pb.SecAggCiphertexts(items=defects[pick % len(defects)])


def _bad_unmask(rnd: Round, agent: str, pick: int, blob: bytes, n: int) -> pb.SecAggUnmaskShares:
    """Unmask messages of ``agent`` with one defect each."""
    good = rnd.unmasks[agent]
    own = sorted(good.self_mask_shares)
    share = lambda o: pb.SecAggShare(owner=o, share=good.self_mask_shares[o])  # noqa: E731
    wrong_len = n if n != SHARE_BYTES else n + 1
    defects = [
        [share(o) for o in own] + [pb.SecAggShare(owner=f"ghost{pick}", share=good.self_mask_shares[own[0]])],
        [share(o) for o in own[1:]],
        [share(o) for o in own] + [share(own[pick % len(own)])],
        [share(o) for o in own[1:]] + [pb.SecAggShare(owner=own[0], share=blob[:wrong_len])],
    ]
    if pick % 5 == 4:  # a survivor's self-mask share sent as a key share (that would reveal its mask key)
        return pb.SecAggUnmaskShares(self_mask_shares=[share(o) for o in own[1:]], key_shares=[share(own[0])])
    return pb.SecAggUnmaskShares(self_mask_shares=defects[pick % len(defects)])


def test_low_order_points_are_the_ones_the_key_check_refuses():
    for point in LOW_ORDER:
        with pytest.raises(ValueError, match="low-order"):
            keys.check_public(point)


def test_fuzz_secagg_exchange_stage_by_stage(start_coordinator, agents):
    init = _arrays(0)
    server = start_coordinator(init, secure_aggregation=True, clients_per_round=5, min_available=5,
                               deadline_seconds=120, secagg_stage_seconds=120)
    rnd = Round(server, agents(server.address, IDS))
    last = IDS[-1]

    # Stage 1: all but the last agent advertise; then hostile keys, duplicates and misplaced messages.
    for i in IDS[:-1]:
        assert rnd.call(i, pb.SECAGG_ADVERTISE, public_keys=rnd.adverts[i]).WhichOneof("body") == "wait_seconds"

    def stage1(pick, blob, n):
        if pick % 3 == 0:
            return _common(rnd, last, pick // 3, blob, pb.SECAGG_ADVERTISE)
        agent = last if pick % 3 == 1 else IDS[pick % 4]
        return rnd.request(agent, pb.SECAGG_ADVERTISE, public_keys=_bad_keys(rnd, agent, pick // 3, blob, n))
    _fuzz(rnd, stage1, lambda pick: rnd.request(IDS[pick % 4], pb.SECAGG_ADVERTISE, public_keys=rnd.adverts[IDS[0]]))
    rnd.alive("advertise")
    rnd.odd_waits(pb.SECAGG_ADVERTISE)
    assert set(server.coordinator.secure.server.advertised) == set(IDS[:-1])
    rnd.call(last, pb.SECAGG_ADVERTISE, public_keys=rnd.adverts[last])
    broadcasts = {i: rnd.call(i, pb.SECAGG_ADVERTISE, wait=10).keys for i in IDS}
    outgoing = {i: rnd.clients[i].share_keys(wire.key_broadcast_from_pb(i, broadcasts[i])).ciphertexts for i in IDS}
    rnd.outgoing = outgoing

    # Stage 2: all but the last agent share; then hostile share lists and out-of-turn messages.
    for i in IDS[:-1]:
        rnd.call(i, pb.SECAGG_SHARE, ciphertexts=wire.ciphertexts_to_pb(outgoing[i]))

    def stage2(pick, blob, n):
        if pick % 4 == 0:
            return _common(rnd, last, pick // 4, blob, pb.SECAGG_SHARE)
        if pick % 4 == 1:
            agent = IDS[pick % 5]
            return rnd.request(agent, pb.SECAGG_ADVERTISE, public_keys=rnd.adverts[agent])  # stage is over
        agent = last if pick % 4 == 2 else IDS[pick % 4]
        return rnd.request(agent, pb.SECAGG_SHARE, ciphertexts=_bad_shares(rnd, agent, pick // 4, blob, n))
    _fuzz(rnd, stage2, lambda pick: rnd.request(IDS[pick % 4], pb.SECAGG_SHARE,
                                                ciphertexts=wire.ciphertexts_to_pb(outgoing[IDS[pick % 4]])))
    rnd.alive("share")
    rnd.odd_waits(pb.SECAGG_SHARE)
    rnd.call(last, pb.SECAGG_SHARE, ciphertexts=wire.ciphertexts_to_pb(outgoing[last]))

    # Stage 3: masked uploads; hostile messages before the last one arrives.
    locals_ = {i: _local(init, k + 1) for k, i in enumerate(IDS)}
    masked = {}
    for i in IDS:
        routed = rnd.call(i, pb.SECAGG_SHARE, wait=10).ciphertexts
        vector = rnd.clients[i].masked_input(wire.routed_shares_from_pb(i, routed),
                                             flat_update(locals_[i], init), COUNTS[i]).vector.view(np.int32)
        masked[i] = list(upload_messages(rnd.bots[i].auth, rnd.tasks[i], ModelLayout(
            [(MASKED_TENSOR, "int32", vector.shape)]), [vector], 1, 0, {}, 64 << 10))
    for i in IDS[:-1]:
        assert rnd.bots[i].upload(rnd.tasks[i], None, 0, messages=masked[i]).accepted

    def stage3(pick, blob, n):
        if pick % 3 == 0:
            return _common(rnd, last, pick // 3, blob, pb.SECAGG_MASKED)
        agent = IDS[pick % 5]
        if pick % 3 == 1:
            return rnd.request(agent, pb.SECAGG_SHARE, ciphertexts=wire.ciphertexts_to_pb(outgoing[agent]))
        return rnd.request(agent, pb.SECAGG_UNMASK, unmask_shares=pb.SecAggUnmaskShares(
            self_mask_shares=[pb.SecAggShare(owner=p, share=blob) for p in IDS]))
    _fuzz(rnd, stage3, lambda pick: rnd.request(IDS[pick % 5], pb.SECAGG_SHARE,
                                                ciphertexts=wire.ciphertexts_to_pb(outgoing[IDS[pick % 5]])))
    rnd.alive("mask")
    rnd.odd_waits(pb.SECAGG_MASKED)
    assert server.coordinator.current.accepted == 4
    assert rnd.bots[last].upload(rnd.tasks[last], None, 0, messages=masked[last]).accepted

    # Stage 4: unmask shares; hostile ones before the last agent's arrive.
    for i in IDS:
        survivors = rnd.call(i, pb.SECAGG_MASKED, wait=10).survivors
        rnd.unmasks[i] = rnd.clients[i].unmask(wire.unmask_request_from_pb(i, survivors))
    for i in IDS[:-1]:
        rnd.call(i, pb.SECAGG_UNMASK, unmask_shares=wire.unmask_shares_to_pb(rnd.unmasks[i]))

    def stage4(pick, blob, n):
        if pick % 3 == 0:
            return _common(rnd, last, pick // 3, blob, pb.SECAGG_UNMASK)
        agent = last if pick % 3 == 1 else IDS[pick % 4]
        return rnd.request(agent, pb.SECAGG_UNMASK, unmask_shares=_bad_unmask(rnd, agent, pick // 3, blob, n))
    _fuzz(rnd, stage4, lambda pick: rnd.request(IDS[pick % 4], pb.SECAGG_UNMASK,
                                                unmask_shares=wire.unmask_shares_to_pb(rnd.unmasks[IDS[pick % 4]])))
    rnd.alive("unmask")
    rnd.odd_waits(pb.SECAGG_UNMASK)
    rnd.call(last, pb.SECAGG_UNMASK, unmask_shares=wire.unmask_shares_to_pb(rnd.unmasks[last]))

    # The round ends as FedAvg of the honest updates: nothing hostile reached the sum.
    assert server.wait(30)
    row = server.coordinator.metrics.last
    assert (row["status"], row["reported"], row["secagg_survivors"]) == ("ok", 5, 5), row
    total = sum(COUNTS.values())
    for k, new in enumerate(server.coordinator.weights):
        expected = sum(COUNTS[i] * locals_[i][k].astype(np.float64) for i in IDS) / total
        np.testing.assert_allclose(new, expected, rtol=0, atol=1e-5)
