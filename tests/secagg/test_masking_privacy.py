"""A single masked upload looks uniformly random whatever the update; a 1M-parameter round stays fast."""

import time

import numpy as np
from scipy import stats

P_MIN = 1e-4  # each test here fails by chance with probability <= 1e-4 (masks come from the OS RNG)


def _masked_uploads(make_round, updates, weights):
    ids = sorted(updates)
    rnd = make_round(ids, next(iter(updates.values())).size, clip=1.0, max_weight=100)
    s = rnd.server
    for i in ids:
        s.receive_advertise(rnd.clients[i].advertise())
    s.close_advertising()
    for i in ids:
        s.receive_shares(rnd.clients[i].share_keys(s.key_broadcast(i)))
    s.close_sharing()
    return {i: rnd.clients[i].masked_input(s.routed_shares(i), updates[i], weights[i]).vector for i in ids}


def test_masked_uploads_of_opposite_updates_are_uniform_and_indistinguishable(make_round):
    n = 200_000
    updates = {"zeros": np.zeros(n), "ones": np.ones(n), "ramp": np.linspace(-1, 1, n)}
    masked = _masked_uploads(make_round, updates, {"zeros": 100, "ones": 100, "ramp": 100})
    for name, y in masked.items():
        u = y[:-1].astype(np.float64) / 2.0 ** 32
        assert stats.kstest(u, "uniform").pvalue > P_MIN, name
        counts = np.bincount((y[:-1] >> 24).astype(np.int64), minlength=256)  # top byte: 256 equal cells
        assert stats.chisquare(counts).pvalue > P_MIN, name
    # A constant update (all zeros) and the largest one (all +clip) give samples of one distribution.
    assert stats.ks_2samp(masked["zeros"][:-1], masked["ones"][:-1]).pvalue > P_MIN


def test_masked_upload_is_uncorrelated_with_its_update(make_round):
    n = 200_000
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, n)
    masked = _masked_uploads(make_round, {"x": x, "y": rng.uniform(-1, 1, n), "z": np.zeros(n)},
                             {"x": 60, "y": 7, "z": 1})
    signed = masked["x"][:-1].view(np.int32).astype(np.float64)  # the view a decoder would take
    r, p = stats.pearsonr(signed, x)
    assert abs(r) < 0.02 and p > P_MIN
    rho, p = stats.spearmanr(masked["x"][:-1][:50_000], x[:50_000])
    assert abs(rho) < 0.03 and p > P_MIN
    assert masked["x"][-1] != 60 or masked["y"][-1] != 7  # the weight coordinate is masked too


def test_one_million_parameter_round_is_exact_and_fast(make_round):
    ids = ["a", "b", "c", "d"]
    n = 1_000_000
    rng = np.random.default_rng(1)
    updates = {i: rng.standard_normal(n).astype(np.float32) * 0.1 for i in ids}
    weights = {"a": 10, "b": 20, "c": 30, "d": 40}
    rnd = make_round(ids, n, clip=1.0, max_weight=100)
    start = time.perf_counter()
    result = rnd.run(updates, weights, {"d": "mask"})  # d drops: its pairwise masks must be removed
    seconds = time.perf_counter() - start
    total, weight = rnd.plain(updates, weights, ["a", "b", "c"])
    assert result.weight_sum == weight == 60
    np.testing.assert_allclose(result.mean, total / weight, rtol=0, atol=result.error_bound)
    assert seconds < 10.0, f"a 4-client 1M-parameter round took {seconds:.1f}s"
