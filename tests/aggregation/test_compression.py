"""Compression round trips stay within their stated bounds; top-k error feedback loses nothing; bytes are counted."""

import numpy as np
import pytest

from fedpar.aggregation import (CompressionConfig, Compressor, Encoded, decode, encode, encode_update)

from support.compression_refs import decode_update


def deltas(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((64, 33)) * 10.0 ** rng.uniform(-4, 1, (64, 33))).astype(dtype),
            rng.standard_normal(1001).astype(dtype), np.zeros(7, dtype)]


def test_fp16_and_bf16_relative_bounds():
    x = deltas()
    for method, rel, absol, itemsize in [("fp16", 2.0 ** -11, 2.0 ** -25, 2), ("bf16", 2.0 ** -8, 2.0 ** -133, 2)]:
        enc = encode(x, CompressionConfig(method=method))
        y = decode(enc)
        assert enc.nbytes == sum(a.size for a in x) * itemsize
        for a, b in zip(x, y):
            assert b.dtype == a.dtype and b.shape == a.shape
            err = np.abs(b.astype(np.float64) - a)
            assert np.all(err <= rel * np.abs(a) + absol), (method, err.max())
            if method == "bf16" and a.any():  # bf16 is float32 truncated to its top 16 bits, rounded to nearest
                assert np.any(err > 0)
    with pytest.raises(ValueError, match="bf16"):
        encode([np.array([7e4], np.float32)], CompressionConfig(method="fp16"))


def test_int8_error_is_below_one_step_per_block_and_unbiased():
    x = deltas(1)
    cfg = CompressionConfig(method="int8", int8_block=128, seed=3)
    enc = encode(x, cfg)
    n = sum(a.size for a in x)
    assert enc.nbytes == n + 4 * sum(-(-a.size // 128) for a in x)
    for a, b in zip(x, decode(enc)):
        flat, got = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
        for s in range(0, flat.size, 128):
            step = np.abs(flat[s:s + 128]).max() / 127
            assert np.all(np.abs(got[s:s + 128] - flat[s:s + 128]) <= step * (1 + 2 ** -20))
    np.testing.assert_array_equal(decode(enc)[2], np.zeros(7, np.float32))
    # unbiased: the mean of many independent quantizations converges to the input
    a = x[1][:128]
    mean = np.mean([decode(encode([a], CompressionConfig("int8", int8_block=128, seed=s)))[0] for s in range(400)], 0)
    step = np.abs(a).max() / 127
    assert np.abs(mean - a).max() < 0.2 * step  # ~4 standard errors of a mean of 400 draws (sd <= step/2)


def test_topk_keeps_largest_and_error_feedback_loses_nothing():
    x = deltas(2)
    cfg = CompressionConfig(method="topk", topk_ratio=0.05)
    enc = encode(x, cfg)
    y = decode(enc)
    flat, got = x[1], y[1]
    k = int(np.ceil(0.05 * flat.size))
    assert np.count_nonzero(got) == k
    assert np.abs(flat[got == 0]).max() <= np.abs(flat[got != 0]).min()
    comp = Compressor(cfg)
    total_in = [np.zeros_like(a) for a in x]
    total_out = [np.zeros_like(a, dtype=np.float64) for a in x]
    for r in range(5):
        d = deltas(10 + r)
        old = comp.residual("alice")
        sent = decode(comp.encode(d, "alice"))
        new = comp.residual("alice")
        for a, s, o, nr in zip(d, sent, old or [np.zeros_like(a) for a in d], new):
            np.testing.assert_allclose(s + nr, a + o, rtol=0, atol=1e-6)  # x' + new residual == x + old residual
        total_in = [t + a for t, a in zip(total_in, d)]
        total_out = [t + s for t, s in zip(total_out, sent)]
    for ti, to, r in zip(total_in, total_out, comp.residual("alice")):  # everything eventually arrives
        np.testing.assert_allclose(to + r, ti, atol=1e-5)
    assert comp.residual("bob") is None


def test_compressed_sizes_and_update_round_trip():
    rng = np.random.default_rng(4)
    g = [rng.standard_normal((100, 10)).astype(np.float32), rng.standard_normal(10).astype(np.float32)]
    raw = sum(a.nbytes for a in g)
    for method, expected_ratio in [("none", 1.0), ("fp16", 2.0), ("bf16", 2.0)]:
        comp = Compressor(CompressionConfig(method=method))
        for c in range(3):
            new = [a + 0.01 * rng.standard_normal(a.shape).astype(np.float32) for a in g]
            enc = encode_update(comp, new, g, f"c{c}")
            assert raw / enc.nbytes == pytest.approx(expected_ratio)
            back = decode_update(comp, enc, g)
            for a, b in zip(new, back):
                assert b.dtype == np.float32
                np.testing.assert_allclose(b, a, atol=1e-4 if method != "none" else 1e-7)
    comp = Compressor(CompressionConfig(method="topk", topk_ratio=0.01))
    # 1% of 1000 and ceil of 1% of 10, uint32 index + float32 value
    assert comp.encode(g, "c").nbytes == (10 + 1) * 8


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="one of"):
        CompressionConfig(method="zip")
    with pytest.raises(ValueError, match="NaN"):
        encode([np.array([np.nan], np.float32)], CompressionConfig("fp16"))
    with pytest.raises(ValueError, match="floating-point"):
        encode([np.arange(3)], CompressionConfig("fp16"))
    bad = Encoded("topk", {"0.idx": np.array([5], np.uint32), "0.val": np.ones(1, np.float32)},
                  {"shapes": [[3]], "dtypes": ["float32"]})
    with pytest.raises(ValueError, match="outside"):
        decode(bad)
