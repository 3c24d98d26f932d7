"""--max-agent-share: the capped FedAvg equals a weighted mean with water-filled weights, whatever order the
updates arrive in, while the strategy holds back at most ceil(1/share) - 1 of them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedpar.aggregation import build_strategy
from fedpar.aggregation.share_cap import ShareCap, clip_level


def _reference(weights: list[float], share: float) -> list[float]:
    """Water-filling by bisection on the level L: min(w, L) with max share = share (or equal weights)."""
    if len(weights) * share < 1:
        return [1.0] * len(weights)
    if max(weights) <= share * sum(weights):
        return list(weights)
    lo, hi = 0.0, max(weights)
    for _ in range(200):
        level = (lo + hi) / 2
        if level <= share * sum(min(w, level) for w in weights):
            lo = level
        else:
            hi = level
    return [min(w, lo) for w in weights]


@pytest.mark.parametrize("share", [0.5, 0.3, 0.25, 0.2, 0.1])
def test_streamed_capped_fedavg_equals_the_water_filled_weighted_mean(share):
    rng = np.random.default_rng(int(share * 100))
    for trial in range(30):
        n = int(rng.integers(1, 12))
        weights = [float(w) for w in rng.choice([1, 5, 100, 1000, 10**6], n)]
        updates = [[rng.standard_normal((3, 2)).astype(np.float64)] for _ in range(n)]
        strategy = build_strategy("fedavg")
        strategy.cap_shares(share)
        strategy.begin_round(1, [np.zeros((3, 2))])
        for update, weight in zip(updates, weights):
            strategy.fold(update, weight)
        assert strategy._cap.held <= math.ceil(1 / share) - 1
        got, _ = strategy.finish()
        capped = _reference(weights, share)
        expect = sum(c * u[0] for c, u in zip(capped, updates)) / sum(capped)
        np.testing.assert_allclose(got[0], expect, rtol=1e-7, atol=1e-9, err_msg=f"{weights} share {share}")
        if n * share >= 1:
            assert max(capped) / sum(capped) <= share + 1e-9


def test_one_heavy_update_moves_the_model_by_at_most_its_capped_share():
    strategy = build_strategy("fedavg")
    strategy.cap_shares(0.25)
    strategy.begin_round(1, [np.zeros(4, np.float32)])
    strategy.fold([np.full(4, 1000.0, np.float32)], 10**7, "evil")
    for i in range(4):
        strategy.fold([np.ones(4, np.float32)], 100, f"h{i}")
    new, metrics = strategy.finish()
    np.testing.assert_allclose(new[0], 0.25 * 1000 + 0.75 * 1.0, rtol=1e-6)
    assert metrics["num_examples"] == pytest.approx(400 / 0.75)


def test_clip_level_edge_cases_and_refusals():
    assert clip_level([5.0], 5.0, 5.0, 1, 0.5) == math.inf  # an even split is within a cap of one half
    assert clip_level([9.0], 1.0, 1.0, 1, 0.5) == 1.0  # two updates under a half: equal weights
    assert clip_level([9.0, 3.0], 0.0, 0.0, 0, 0.25) == 3.0  # too few updates for the cap: equal weights
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        ShareCap(0)
    with pytest.raises(ValueError, match="--max-agent-share"):
        build_strategy("median").cap_shares(0.5)


@pytest.mark.parametrize("k", [3, 6, 7, 49])
def test_a_cap_of_one_over_k_on_k_updates_weighs_them_equally(k):
    """share = 1/k with k updates: only equal weights meet the cap. 1 - 2 * (1/3) rounds above 1/3 and 49 * (1/49)
    below 1, so weights 1, 2, 3 under 1/3 were capped to 1, 2, 2 (a share of 0.4) and 1..49 under 1/49 to 1, 2, 2, ..."""
    share = 1 / k
    rng = np.random.default_rng(k)
    updates = [[rng.standard_normal(3)] for _ in range(k)]
    strategy = build_strategy("fedavg")
    strategy.cap_shares(share)
    strategy.begin_round(1, [np.zeros(3)])
    for j, update in enumerate(updates):
        strategy.fold(update, float(j + 1), f"c{j}")
    got, metrics = strategy.finish()
    np.testing.assert_allclose(got[0], np.mean([u[0] for u in updates], axis=0), rtol=1e-12, atol=1e-15)
    assert metrics["num_examples"] == pytest.approx(k)  # each counted with the lightest's weight, 1
    assert clip_level([3.0, 2.0], 1.0, 1.0, 1, 1 / 3) == pytest.approx(1.0, rel=1e-12)
