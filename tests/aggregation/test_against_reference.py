"""fedpar's strategies against independent references: Flower's own aggregate functions, the papers' formulas in
plain numpy, and an RDP accountant written out from its definition (a quadrature, not opacus's series)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from scipy import integrate

from fedpar.aggregation import FoldConfig, FoldItem, build_strategy
from fedpar.aggregation.accountant import PrivacyAccountant

aggregate = pytest.importorskip("flwr.server.strategy.aggregate")

SHAPES = [(5, 3), (7,), (), (2, 2, 2)]
# float tolerance of the result against a float64 reference, by the model's dtype (integers: rounded to nearest)
TOL = {np.float16: 2e-3, np.float32: 2e-6, np.float64: 1e-12, np.int64: 0.5, np.int32: 0.5}
WEIGHTS = {"spread": [1, 10**9, 1000, 7, 1], "one": [5], "equal": [3, 3, 3, 3, 3]}


def draw(rng, dtype):
    if np.issubdtype(dtype, np.integer):  # a buffer such as BatchNorm's num_batches_tracked
        return [rng.integers(0, 1000, s).astype(dtype) for s in SHAPES]
    return [(10 * rng.standard_normal(s)).astype(dtype) for s in SHAPES]


def run(name, results, global_w, **options):
    strategy = build_strategy(name, **options)
    strategy.begin_round(1, global_w)
    for j, (u, n) in enumerate(results):
        strategy.fold(u, n, f"c{j}")
    return strategy.finish()[0]


def assert_matches(got, want, dtype):
    for a, b in zip(got, want):
        assert a.dtype == dtype and a.shape == np.shape(b)
        scale = max(1.0, float(np.max(np.abs(b)))) if dtype not in (np.int64, np.int32) else 1.0
        np.testing.assert_allclose(a.astype(np.float64), b, rtol=0, atol=TOL[dtype] * scale)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int64])
@pytest.mark.parametrize("weights", WEIGHTS.values(), ids=WEIGHTS.keys())
def test_fedavg_median_trimmed_mean_and_krum_match_flowers_aggregate(dtype, weights):
    rng = np.random.default_rng(len(weights) + np.dtype(dtype).itemsize)
    g = draw(rng, dtype)
    results = [(draw(rng, dtype), w) for w in weights]
    if weights is WEIGHTS["equal"]:
        results = [(results[0][0], w) for w in weights]  # all-equal updates: every rule gives that update back
    r64 = [([a.astype(np.float64) for a in u], w) for u, w in results]
    assert_matches(run("fedavg", results, g), aggregate.aggregate(r64), dtype)
    assert_matches(run("median", results, g), aggregate.aggregate_median(r64), dtype)
    for beta in (0.0, 0.2, 0.49):  # 0.49 of 5 updates trims 2 a side: the median's one survives
        assert_matches(run("trimmed_mean", results, g, beta=beta), aggregate.aggregate_trimmed_avg(r64, beta), dtype)
    logging.disable(logging.WARNING)  # f >= n/2 - 1 says Krum's guarantee is void, and runs as Flower does
    try:
        for f in (0, 1, 3):  # 3: n <= 2f + 2
            assert_matches(run("krum", results, g, num_malicious=f), aggregate.aggregate_krum(r64, f, 0), dtype)
    finally:
        logging.disable(logging.NOTSET)


def test_median_of_tied_values_and_krum_with_a_duplicated_update():
    rng = np.random.default_rng(1)
    base = rng.standard_normal(6)
    results = [([base], 1), ([base], 2), ([base + 1], 3), ([base - 1], 4), ([base + 5], 1)]
    r64 = [(u, w) for u, w in results]
    np.testing.assert_array_equal(run("median", results, [base])[0], aggregate.aggregate_median(r64)[0])
    # the two copies of base are each other's nearest: both score 0, the first is picked (Flower's argmin too)
    np.testing.assert_array_equal(run("krum", results, [base], num_malicious=1)[0], base)
    np.testing.assert_array_equal(aggregate.aggregate_krum(r64, 1, 0)[0], base)


@pytest.mark.parametrize("backend", ["torch", "numpy", "blas"])
def test_the_streaming_sum_is_the_same_mean_whatever_the_order_and_grouping(backend):
    rng = np.random.default_rng(2)
    updates = [[rng.standard_normal(s).astype(np.float32) for s in [(3000,), (7, 5)]] for _ in range(11)]
    weights = [1, 3, 1e6, 7, 0.5, 2, 9, 1e-3, 4, 11, 5]
    want = [sum(w * u[i].astype(np.float64) for u, w in zip(updates, weights)) / sum(weights) for i in range(2)]
    for group, workers in ((1, 1), (3, 2), (8, 2)):
        config = FoldConfig(backend=backend, group_size=group, num_workers=workers, min_parallel_elements=16,
                            block_elements=64)
        strategy = build_strategy("fedavg", fold_config=config)
        strategy.begin_round(1, [np.zeros_like(a) for a in updates[0]])
        items = [FoldItem(updates[j], weights[j], f"c{j}") for j in rng.permutation(11)]
        assert strategy.fold_many(items[:4]) == [None] * 4
        strategy.fold(*items[4][:4])
        assert strategy.fold_many(items[5:]) == [None] * 6
        got, metrics = strategy.finish()
        assert metrics["num_examples"] == pytest.approx(sum(weights), rel=1e-15)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _rdp(q: float, sigma: float, alpha: float) -> float:
    """Renyi DP of order alpha of the Poisson-sampled Gaussian mechanism, from its definition:
    log E_{z ~ N(0, s^2)}[((1 - q) + q exp((2z - 1) / (2 s^2)))^alpha] / (alpha - 1), by quadrature."""
    def log_integrand(z):
        ratio = np.logaddexp(math.log1p(-q), math.log(q) + (2 * z - 1) / (2 * sigma ** 2))
        return -0.5 * (z / sigma) ** 2 - 0.5 * math.log(2 * math.pi * sigma ** 2) + alpha * ratio
    peak = max(log_integrand(z) for z in np.linspace(-40 * sigma, 40 * sigma + alpha, 200))
    value, _ = integrate.quad(lambda z: math.exp(log_integrand(z) - peak), -np.inf, np.inf, limit=500,
                              epsabs=0, epsrel=1e-12)
    return (peak + math.log(value)) / (alpha - 1)


def _epsilon(q: float, sigma: float, rounds: int, delta: float) -> float:
    """The smallest epsilon over the orders opacus uses, by Balle et al. 2020's RDP-to-(epsilon, delta) conversion."""
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    return min(rounds * _rdp(q, sigma, a) - (math.log(delta) + math.log(a)) / (a - 1) + math.log((a - 1) / a)
               for a in orders)


def test_dp_fedavg_reports_the_epsilon_of_its_noise_sampling_rate_and_rounds():
    sigma, population, sampled, per_round, delta, rounds = 1.1, 50, 5, 4, 1e-5, 6
    strategy = build_strategy("dp-fedavg", noise_multiplier=sigma, clip_norm=1.0, population=population,
                              clients_per_round=per_round, sampled_per_round=sampled, delta=delta, seed=0)
    rng = np.random.default_rng(3)
    g = [np.zeros(4, np.float32)]
    for r in range(1, rounds + 1):
        strategy.begin_round(r, g)
        for j in range(per_round):
            strategy.fold([rng.standard_normal(4).astype(np.float32)], 10, f"c{j}")
        g, metrics = strategy.finish()
    assert metrics["dp_sample_rate"] == sampled / population and metrics["dp_delta"] == delta
    assert metrics["dp_epsilon"] == pytest.approx(_epsilon(sampled / population, sigma, rounds, delta), rel=1e-9)
    accountant = PrivacyAccountant(1e-6)
    for _ in range(40):
        accountant.step(0.8, 0.05)
    assert accountant.epsilon() == pytest.approx(_epsilon(0.05, 0.8, 40, 1e-6), rel=1e-9)
