"""The four SecAgg+ stages in process: exact sums, recovery from dropouts, clean aborts, refused messages."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedpar.secagg.errors import SecAggAbort, SecAggError
from fedpar.secagg.messages import AdvertiseKeys, MaskedInput, ShareKeys, UnmaskRequest, UnmaskShares


def _inputs(ids, length, seed=0, max_weight=100):
    rng = np.random.default_rng(seed)
    updates = {i: rng.uniform(-1.5, 1.5, length).astype(np.float32) for i in ids}
    weights = {i: int(rng.integers(1, max_weight + 1)) for i in ids}
    return updates, weights


def _check(result, rnd, updates, weights, expected_ids):
    assert result.survivors == tuple(sorted(expected_ids))
    total, weight = rnd.plain(updates, weights, expected_ids)
    assert result.weight_sum == weight
    bound = result.error_bound
    assert bound < 1e-6
    np.testing.assert_allclose(result.mean, total / weight, rtol=0, atol=bound)


IDS7 = [f"c{i}" for i in range(7)]
IDS30 = [f"agent-{i:02d}" for i in range(30)]


@pytest.mark.parametrize("ids", [IDS7, IDS30], ids=["complete-7", "harary-30"])
def test_unmasked_sum_equals_plain_weighted_sum_within_quantization_error(make_round, ids):
    rnd = make_round(ids, 500)
    if len(ids) == 30:
        assert rnd.params.neighbours == 20 < 29  # SecAgg+: not the complete graph
    updates, weights = _inputs(ids, 500)
    _check(rnd.run(updates, weights), rnd, updates, weights, ids)


@pytest.mark.parametrize("ids", [IDS7, IDS30], ids=["complete-7", "harary-30"])
def test_dropouts_below_threshold_at_every_stage_are_recovered(make_round, ids):
    rnd = make_round(ids, 300)
    updates, weights = _inputs(ids, 300, seed=1)
    drop_at = {ids[0]: "share", ids[2]: "mask", ids[4]: "unmask"}  # after stages 1, 2 and 3
    result = rnd.run(updates, weights, drop_at)
    assert result.dropped == (ids[2],)
    _check(result, rnd, updates, weights, [i for i in ids if drop_at.get(i) not in ("share", "mask")])


def test_two_of_five_drop_after_masking_and_the_sum_is_recovered(make_round):
    ids = ["a", "b", "c", "d", "e"]
    rnd = make_round(ids, 200)
    assert rnd.params.threshold == 3
    updates, weights = _inputs(ids, 200, seed=2)
    result = rnd.run(updates, weights, {"b": "unmask", "e": "unmask"})
    _check(result, rnd, updates, weights, ids)  # their inputs arrived: they count


def test_two_of_five_drop_before_masking_and_the_sum_is_recovered(make_round):
    ids = ["a", "b", "c", "d", "e"]
    rnd = make_round(ids, 200)
    updates, weights = _inputs(ids, 200, seed=3)
    result = rnd.run(updates, weights, {"a": "mask", "d": "mask"})
    assert result.dropped == ("a", "d")
    _check(result, rnd, updates, weights, ["b", "c", "e"])


@pytest.mark.parametrize("drop_at, match", [
    ({"a": "unmask", "b": "unmask", "c": "unmask"}, "sent unmask shares"),
    ({"a": "mask", "b": "mask", "c": "mask"}, "sent masked inputs"),
    ({"a": "mask", "b": "mask", "c": "unmask"}, "sent unmask shares"),
    ({"a": "share", "b": "share", "c": "share"}, "shared keys"),
    ({"a": "advertise", "b": "advertise", "c": "advertise"}, "advertised keys"),
])
def test_dropouts_above_threshold_abort_cleanly(make_round, drop_at, match):
    ids = ["a", "b", "c", "d", "e"]
    rnd = make_round(ids, 50)
    updates, weights = _inputs(ids, 50)
    with pytest.raises(SecAggAbort, match=match):
        rnd.run(updates, weights, drop_at)
    assert rnd.server.stage == "aborted"
    with pytest.raises(SecAggAbort, match="aborted"):
        rnd.server.receive_advertise(AdvertiseKeys("e", bytes(32), bytes(32)))


def test_one_owner_with_too_few_surviving_holders_aborts_the_round(make_round):
    ids = [f"n{i:02d}" for i in range(12)]
    rnd = make_round(ids, 40, neighbours=4)  # 5 holders per owner, threshold 3
    assert rnd.params.threshold == 3
    owner = ids[0]
    first, second = sorted(rnd.params.graph[owner])[:2]
    updates, weights = _inputs(ids, 40)
    with pytest.raises(SecAggAbort, match=f"self-mask seed of '{owner}'"):
        rnd.run(updates, weights, {owner: "unmask", first: "unmask", second: "unmask"})


# ---------------------------------------------------------------- refused messages
def _to_stage(rnd, stage, ids):
    """Advance every client of ``rnd`` up to (not into) ``stage``; returns the last outgoing messages."""
    s, out = rnd.server, {}
    for i in ids:
        out[i] = rnd.clients[i].advertise()
    if stage == "advertise":
        return out
    for i in ids:
        s.receive_advertise(out[i])
    s.close_advertising()
    for i in ids:
        out[i] = rnd.clients[i].share_keys(s.key_broadcast(i))
    if stage == "share":
        return out
    for i in ids:
        s.receive_shares(out[i])
    s.close_sharing()
    return {i: s.routed_shares(i) for i in ids}


def test_server_refuses_foreign_duplicate_and_malformed_key_adverts(make_round):
    ids = ["a", "b", "c", "d"]
    rnd = make_round(ids, 10)
    ads = _to_stage(rnd, "advertise", ids)
    s = rnd.server
    s.receive_advertise(ads["a"])
    for bad, match in [(ads["a"], "already"), (dataclasses.replace(ads["b"], sender="mallory"), "not a participant"),
                       (dataclasses.replace(ads["b"], c_public=b"x" * 31), "32 bytes"),
                       (dataclasses.replace(ads["b"], s_public=ads["a"].s_public), "repeat"),
                       (dataclasses.replace(ads["b"], s_public=bytes(32)), "low-order"),
                       (dataclasses.replace(ads["b"], c_public=(1).to_bytes(32, "little")), "low-order")]:
        with pytest.raises(SecAggError, match=match):
            s.receive_advertise(bad)
    with pytest.raises(SecAggError, match="stage"):
        s.receive_shares(ShareKeys("a", {}))
    assert s.advertised == ("a",)


def test_server_refuses_share_messages_with_wrong_recipients_or_sizes(make_round):
    ids = ["a", "b", "c", "d"]
    rnd = make_round(ids, 10)
    shares = _to_stage(rnd, "share", ids)
    s = rnd.server
    cts = shares["a"].ciphertexts
    missing = dict(list(cts.items())[1:])
    extra = {**cts, "zed": next(iter(cts.values()))}
    short = {k: v[:-1] for k, v in cts.items()}
    for bad, match in [(ShareKeys("a", missing), "exactly"), (ShareKeys("a", extra), "exactly"),
                       (ShareKeys("a", short), "bytes"), (ShareKeys("zed", cts), "not a participant")]:
        with pytest.raises(SecAggError, match=match):
            s.receive_shares(bad)
    s.receive_shares(shares["a"])
    with pytest.raises(SecAggError, match="already"):
        s.receive_shares(shares["a"])


def test_client_refuses_tampered_or_misrouted_share_ciphertexts(make_round):
    ids = ["a", "b", "c", "d"]
    rnd = make_round(ids, 10)
    routed = _to_stage(rnd, "mask", ids)
    msg = routed["a"]
    flipped = bytearray(msg.ciphertexts["b"])
    flipped[-1] ^= 0x40
    misrouted = rnd.server._shares["b"]["c"]  # b's ciphertext for c, handed to a
    for cts, match in [({**msg.ciphertexts, "b": bytes(flipped)}, "authentication"),
                       ({**msg.ciphertexts, "b": misrouted}, "authentication"),
                       ({**msg.ciphertexts, "b": msg.ciphertexts["c"]}, "authentication")]:
        with pytest.raises(SecAggError, match=match):
            rnd.clients["a"].masked_input(dataclasses.replace(msg, ciphertexts=cts), np.zeros(10), 1)
    with pytest.raises(SecAggError, match="addressed"):
        rnd.clients["a"].masked_input(routed["b"], np.zeros(10), 1)
    assert rnd.clients["a"].stage == "mask"  # nothing changed: the genuine message still works
    assert rnd.clients["a"].masked_input(msg, np.zeros(10), 1).vector.shape == (11,)


def test_refused_masked_and_unmask_messages_change_nothing(make_round):
    ids = ["a", "b", "c", "d", "e"]
    rnd = make_round(ids, 20)
    updates, weights = _inputs(ids, 20, seed=5)
    routed = _to_stage(rnd, "mask", ids)
    s = rnd.server
    masked = {i: rnd.clients[i].masked_input(routed[i], updates[i], weights[i]) for i in ids}
    s.receive_masked(masked["a"])
    v = masked["b"].vector
    for bad, match in [(masked["a"], "already"), (MaskedInput("b", v[:-1]), "uint32 vector"),
                       (MaskedInput("b", v.astype(np.int64)), "uint32 vector"),
                       (MaskedInput("b", v.astype(">u4")), "uint32 vector"), (MaskedInput("x", v), "participant")]:
        with pytest.raises(SecAggError, match=match):
            s.receive_masked(bad)
    for i in "bcde":
        s.receive_masked(masked[i])
    s.close_masking()
    replies = {i: rnd.clients[i].unmask(s.unmask_request(i)) for i in ids}
    good = replies["a"]
    both = dataclasses.replace(good, key_shares={"b": good.self_mask_shares["b"]})  # b's key AND b's mask seed
    short = dataclasses.replace(good, self_mask_shares={**good.self_mask_shares, "c": b"\x01" * 65})
    missing = dataclasses.replace(good, self_mask_shares={k: v for k, v in good.self_mask_shares.items() if k != "c"})
    for bad, match in [(both, "exactly"), (short, "bytes"), (missing, "exactly"),
                       (UnmaskShares("q", {}, {}), "participant")]:
        with pytest.raises(SecAggError, match=match):
            s.receive_unmask(bad)
    for i in ids:
        s.receive_unmask(replies[i])
    with pytest.raises(SecAggError, match="already"):
        s.receive_unmask(replies["a"])
    _check(s.finish(), rnd, updates, weights, ids)


def test_a_wrong_share_value_aborts_instead_of_returning_a_wrong_sum(make_round):
    ids = ["a", "b", "c", "d", "e"]
    rnd = make_round(ids, 20)
    updates, weights = _inputs(ids, 20, seed=6)
    routed = _to_stage(rnd, "mask", ids)
    s = rnd.server
    for i in ids:
        s.receive_masked(rnd.clients[i].masked_input(routed[i], updates[i], weights[i]))
    s.close_masking()
    for i in ids:
        reply = rnd.clients[i].unmask(s.unmask_request(i))
        if i == "a":  # corrupt one share of every owner: the extra share exposes it
            reply = dataclasses.replace(reply, self_mask_shares={
                k: (int.from_bytes(v, "big") ^ 1).to_bytes(len(v), "big") for k, v in reply.self_mask_shares.items()})
        s.receive_unmask(reply)
    with pytest.raises(SecAggAbort, match="inconsistent"):
        s.finish()


def test_client_refuses_unsafe_unmask_requests_and_foreign_key_broadcasts(make_round):
    ids = [f"n{i:02d}" for i in range(12)]
    rnd = make_round(ids, 10, neighbours=4)
    me = ids[0]
    stranger = next(i for i in ids if i != me and i not in rnd.params.graph[me])
    ads = _to_stage(rnd, "advertise", ids)
    s = rnd.server
    for i in ids:
        s.receive_advertise(ads[i])
    s.close_advertising()
    broadcast = s.key_broadcast(me)
    client = rnd.clients[me]
    with pytest.raises(SecAggError, match="non-neighbours"):
        client.share_keys(dataclasses.replace(broadcast, keys={**broadcast.keys, stranger: s._keys[stranger]}))
    dup = dict(broadcast.keys)
    first, second = sorted(dup)[:2]
    dup[second] = dup[first]
    with pytest.raises(SecAggError, match="repeat"):
        client.share_keys(dataclasses.replace(broadcast, keys=dup))
    with pytest.raises(SecAggError, match="stage"):
        client.unmask(UnmaskRequest(me, tuple(ids)))
    with pytest.raises(SecAggAbort, match="neighbours advertised"):
        client.share_keys(dataclasses.replace(broadcast, keys=dict(list(broadcast.keys.items())[:1])))
    shares = {i: rnd.clients[i].share_keys(s.key_broadcast(i)) for i in ids if i != me}
    shares[me] = client.share_keys(broadcast)
    for i in ids:
        s.receive_shares(shares[i])
    s.close_sharing()
    updates, weights = _inputs(ids, 10)
    for i in ids:
        s.receive_masked(rnd.clients[i].masked_input(s.routed_shares(i), updates[i], weights[i]))
    s.close_masking()
    for request, match in [(UnmaskRequest(me, tuple(ids[1:])), "leaves out"),
                           (UnmaskRequest(me, (me, me) + tuple(ids[2:])), "duplicates"),
                           (UnmaskRequest(me, (me, ids[1])), "refusing")]:
        with pytest.raises((SecAggError, SecAggAbort), match=match):
            client.unmask(request)


STAGES = ["advertise", "share", "mask", "unmask"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(3, 8), data=st.data())
def test_any_dropout_pattern_either_recovers_the_exact_sum_or_aborts(make_round, n, data):
    ids = [f"p{i}" for i in range(n)]
    drop_at = data.draw(st.dictionaries(st.sampled_from(ids), st.sampled_from(STAGES + [None])))
    drop_at = {k: v for k, v in drop_at.items() if v is not None}
    rnd = make_round(ids, 16)  # a stateless factory: safe to share across examples
    t = rnd.params.threshold
    # In the complete graph every stage's survivors hold shares of everyone: only the counts matter.
    alive = [sum(1 for i in ids if i not in drop_at or STAGES.index(drop_at[i]) > s) for s in range(4)]
    updates, weights = _inputs(ids, 16, seed=n)
    if min(alive) < t:
        with pytest.raises(SecAggAbort):
            rnd.run(updates, weights, drop_at)
        return
    result = rnd.run(updates, weights, drop_at)
    _check(result, rnd, updates, weights, [i for i in ids if drop_at.get(i) not in ("advertise", "share", "mask")])
