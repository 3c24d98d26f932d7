"""SecAgg building blocks: field quantizer, ChaCha20 PRG, X25519/HKDF/AEAD, Shamir, the SecAgg+ graph, params."""

import time

import numpy as np
import pytest

from fedpar.secagg import keys, prg, shamir
from fedpar.secagg.errors import SecAggAbort, SecAggError
from fedpar.secagg.field import DTYPE, INT31_MAX, Quantizer
from fedpar.secagg.graph import check_neighbours, default_neighbours, default_threshold, harary_graph
from fedpar.secagg.params import RoundParams


# ---------------------------------------------------------------- field / quantizer
def test_quantize_then_dequantize_is_within_one_grid_step():
    q = Quantizer(clip=0.5, max_weight=1000, max_clients=10)
    x = np.random.default_rng(0).uniform(-0.7, 0.7, 5000)
    v = q.quantize(x, 37, np.random.default_rng(1))
    assert v.dtype == DTYPE and v.shape == (5001,) and v[-1] == 37
    total, weight = q.dequantize_sum(v)
    assert weight == 37
    assert np.abs(total - 37 * np.clip(x, -0.5, 0.5)).max() < 1 / q.scale


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_sum_of_max_clients_at_the_clip_with_max_weight_does_not_wrap(sign):
    n, w, c = 50, 20_000, 2.0
    q = Quantizer(clip=c, max_weight=w, max_clients=n)
    rng = np.random.default_rng(0)
    acc = np.zeros(11, DTYPE)
    for _ in range(n):
        acc += q.quantize(np.full(10, sign * 5.0), w, rng)  # clipped to sign * c
    total, weight = q.dequantize_sum(acc)
    assert weight == n * w
    np.testing.assert_allclose(total, sign * n * w * c, rtol=0, atol=n / q.scale)
    assert n * (w * c * q.scale + 1) <= INT31_MAX


def test_stochastic_rounding_is_unbiased():
    q = Quantizer(clip=1.0, max_weight=1, max_clients=2)
    x = np.full(200_000, 0.3 / q.scale)  # 0.3 of a grid step
    v = q.quantize(x, 1, np.random.default_rng(2))[:-1]
    assert set(np.unique(v).tolist()) == {0, 1}
    assert abs(v.mean() - 0.3) < 0.01


def test_quantizer_refuses_bad_settings_and_inputs():
    with pytest.raises(SecAggError, match="31-bit"):
        Quantizer(clip=1.0, max_weight=1 << 30, max_clients=4)
    with pytest.raises(SecAggError, match="clip"):
        Quantizer(clip=float("nan"), max_weight=1, max_clients=4)
    q = Quantizer(clip=1.0, max_weight=10, max_clients=4)
    with pytest.raises(SecAggError, match="NaN"):
        q.quantize(np.array([0.0, np.nan]), 1, np.random.default_rng())
    with pytest.raises(SecAggError, match="weight"):
        q.quantize(np.zeros(3), 11, np.random.default_rng())
    with pytest.raises(SecAggAbort, match="weight sum"):
        q.dequantize_sum(np.array([5, 0], DTYPE))


# ---------------------------------------------------------------- PRG
def test_prg_is_deterministic_per_seed_and_nonce():
    a = prg.expand(b"k" * 32, 1000, prg.SELF_MASK_NONCE)
    assert a.dtype == DTYPE and a.shape == (1000,)
    assert np.array_equal(a, prg.expand(b"k" * 32, 1000, prg.SELF_MASK_NONCE))
    assert np.array_equal(a[:10], prg.expand(b"k" * 32, 10, prg.SELF_MASK_NONCE))
    assert (a != prg.expand(b"j" * 32, 1000, prg.SELF_MASK_NONCE)).mean() > 0.99
    assert (a != prg.expand(b"k" * 32, 1000, prg.PAIR_MASK_NONCE)).mean() > 0.99
    with pytest.raises(SecAggError, match="32 bytes"):
        prg.expand(b"short", 10, prg.SELF_MASK_NONCE)


def test_prg_expands_one_million_values_well_under_50_ms():
    seed = bytes(range(32))
    best = min(_timed(lambda: prg.expand(seed, 1_000_000, prg.PAIR_MASK_NONCE)) for _ in range(5))
    assert best < 0.05, f"1M-value mask took {best * 1000:.1f} ms"


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---------------------------------------------------------------- keys
def test_pairwise_seeds_agree_and_depend_on_round_and_pair():
    a, b, c = (keys.generate_private_key() for _ in range(3))
    ab = keys.pairwise_mask_seed(a, keys.public_bytes(b), 7, "alice", "bob")
    assert ab == keys.pairwise_mask_seed(b, keys.public_bytes(a), 7, "bob", "alice")
    assert ab != keys.pairwise_mask_seed(a, keys.public_bytes(b), 8, "alice", "bob")
    assert ab != keys.pairwise_mask_seed(a, keys.public_bytes(c), 7, "alice", "bob")
    assert ab != keys.share_encryption_key(a, keys.public_bytes(b), 7, "alice", "bob")
    assert len(ab) == 32
    assert keys.private_from_bytes(keys.private_bytes(a)).public_key().public_bytes_raw() == keys.public_bytes(a)


def test_low_order_public_key_is_refused():
    with pytest.raises(SecAggError, match="low-order"):
        keys.pairwise_mask_seed(keys.generate_private_key(), bytes(32), 1, "a", "b")
    with pytest.raises(SecAggError, match="32 bytes"):
        keys.pairwise_mask_seed(keys.generate_private_key(), bytes(31), 1, "a", "b")


def test_share_encryption_is_authenticated_and_bound_to_its_direction():
    key = bytes(range(32))
    blob = keys.encrypt(key, b"secret share", keys.share_aad(1, "u", "v"))
    assert keys.decrypt(key, blob, keys.share_aad(1, "u", "v")) == b"secret share"
    tampered = bytearray(blob)
    tampered[20] ^= 1
    for bad_blob, aad in [(bytes(tampered), keys.share_aad(1, "u", "v")), (blob, keys.share_aad(1, "v", "u")),
                          (blob, keys.share_aad(2, "u", "v")), (blob[:10], keys.share_aad(1, "u", "v"))]:
        with pytest.raises(SecAggError):
            keys.decrypt(key, bad_blob, aad)


# ---------------------------------------------------------------- Shamir
def test_any_t_shares_reconstruct_and_fewer_do_not():
    secret = bytes(range(32))
    xs = list(range(1, 8))
    shares = shamir.split(secret, 4, xs)
    rng = np.random.default_rng(0)
    for _ in range(10):
        pick = rng.choice(xs, size=int(rng.integers(4, 8)), replace=False)
        assert shamir.combine({int(x): shares[int(x)] for x in pick}, 4) == secret
    with pytest.raises(SecAggAbort, match="only 3 shares"):
        shamir.combine({x: shares[x] for x in xs[:3]}, 4)


def test_shamir_refuses_malformed_and_detects_inconsistent_shares():
    shares = shamir.split(b"\x07" * 32, 3, [2, 5, 9, 11])
    with pytest.raises(SecAggError, match="bytes"):
        shamir.combine({2: shares[2], 5: shares[5], 9: shares[9][:-1]}, 3)
    with pytest.raises(SecAggError, match="field element"):
        shamir.combine({2: shares[2], 5: shares[5], 9: b"\xff" * shamir.SHARE_BYTES}, 3)
    with pytest.raises(SecAggError, match="index"):
        shamir.combine({0: shares[2], 5: shares[5], 9: shares[9]}, 3)
    with pytest.raises(SecAggError, match="32 bytes"):
        shamir.split(b"short", 2, [1, 2])
    with pytest.raises(SecAggError, match="threshold"):
        shamir.split(b"\x00" * 32, 5, [1, 2, 3])
    wrong = (int.from_bytes(shares[11], "big") + 1).to_bytes(shamir.SHARE_BYTES, "big")
    with pytest.raises(SecAggAbort, match="inconsistent"):
        shamir.combine({2: shares[2], 5: shares[5], 9: shares[9], 11: wrong}, 3)


# ---------------------------------------------------------------- graph
def test_default_neighbours_and_threshold():
    assert [default_neighbours(n) for n in (2, 5, 10, 19, 20, 50, 1000)] == [1, 4, 9, 18, 18, 24, 40]
    assert default_threshold(4) == 3 and default_threshold(9) == 6 and default_threshold(24) == 13


def test_harary_graph_is_k_regular_symmetric_and_seeded():
    ids = [f"a{i:02d}" for i in range(50)]
    g = harary_graph(ids, 24, b"s" * 32)
    assert all(len(nb) == 24 and p not in nb for p, nb in g.items())
    assert all(p in g[q] for p, nb in g.items() for q in nb)
    assert g == harary_graph(list(reversed(ids)), 24, b"s" * 32)
    assert g != harary_graph(ids, 24, b"t" * 32)
    full = harary_graph(ids[:5], 4, b"s" * 32)
    assert all(nb == set(ids[:5]) - {p} for p, nb in full.items())
    for k in (3, 0, 49 + 1):
        with pytest.raises(SecAggError, match="neighbours"):
            check_neighbours(50, k)


# ---------------------------------------------------------------- params
def test_round_params_survive_json_and_refuse_unsafe_values():
    p = RoundParams.create(4, ["c", "a", "b", "d", "e"], 100, 1.0, 50)
    assert p.participants == ("a", "b", "c", "d", "e") and (p.neighbours, p.threshold) == (4, 3)
    assert RoundParams.from_json(p.to_json()) == p
    for bad in ['{"round_id": 1}', "not json", p.to_json().replace('"threshold": 3', '"threshold": 2'),
                p.to_json().replace('"a", "b"', '"b", "a"'), p.to_json().replace('"neighbours": 4', '"neighbours": 3')]:
        with pytest.raises(SecAggError):
            RoundParams.from_json(bad)
    with pytest.raises(SecAggError, match="2.."):
        RoundParams.create(1, ["solo"], 10, 1.0, 5)
