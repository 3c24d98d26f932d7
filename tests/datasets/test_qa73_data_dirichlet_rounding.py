"""Dirichlet partitions deal whole examples in the drawn proportions: at a huge alpha (shares all but equal) two
clients of 20 classes of 10 examples got 90 and 110 (87 and 113 at seed 4), ten clients of BALANCED 94 to 106, because
each class was cut at the floor of its cumulative shares, which short-changed every client but the last by up to one
example a class. Now (datasets/rounding.py) a client's count of a class and its total are the floor or the ceiling of
its drawn share of them, and every example is still dealt exactly once."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedpar.datasets.partition import partition_dirichlet
from fedpar.datasets.rounding import round_shares


def _exact_cover(parts: list[np.ndarray], n: int) -> None:
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(n))


def test_a_huge_alpha_splits_evenly_to_one_example():
    labels = np.repeat(np.arange(20), 10)  # 200 examples, 20 classes
    for seed in range(10):
        parts = partition_dirichlet(labels, 2, alpha=1e6, seed=seed)
        _exact_cover(parts, 200)
        assert all(abs(len(p) - 100) <= 1 for p in parts), (seed, [len(p) for p in parts])
    balanced = np.repeat(np.arange(10), 100)
    for seed in range(5):
        parts = partition_dirichlet(balanced, 10, alpha=1e6, seed=seed)
        _exact_cover(parts, 1000)
        assert all(abs(len(p) - 100) <= 1 for p in parts), (seed, [len(p) for p in parts])
        counts = np.array([np.bincount(balanced[p], minlength=10) for p in parts])
        assert (np.abs(counts - 10) <= 1).all()  # each class too: 10 of each of its 100 to each client, to one


@settings(max_examples=200, deadline=None)
@given(classes=st.integers(1, 12), clients=st.integers(1, 40),
       log_alpha=st.floats(-3, 7, allow_subnormal=False),  # other tests in a worker flush denormals
       seed=st.integers(0, 2**31), sizes=st.lists(st.integers(0, 80), min_size=12, max_size=12))
def test_rounded_shares_keep_every_class_whole_and_each_count_and_total_within_one_of_its_share(
        classes, clients, log_alpha, seed, sizes):
    rng = np.random.default_rng(seed)
    proportions = rng.dirichlet(np.full(clients, 10.0 ** log_alpha), size=classes)
    totals = np.array(sizes[:classes])
    counts = round_shares(proportions, totals, rng)
    shares = proportions / proportions.sum(axis=1, keepdims=True) * totals[:, None]
    assert counts.dtype == np.int64 and (counts >= 0).all()
    np.testing.assert_array_equal(counts.sum(axis=1), totals)  # every example of a class dealt, once
    assert (np.abs(counts - shares) < 1 + 1e-6).all()  # the floor or the ceiling of its share
    assert (np.abs(counts.sum(axis=0) - shares.sum(axis=0)) < 1 + 1e-6).all()  # a client's total: the same


def test_many_clients_are_rounded_quickly_and_to_their_shares():
    rng = np.random.default_rng(0)
    proportions = rng.dirichlet(np.full(10_000, 0.5), size=10)  # MNIST over 10,000 clients
    totals = np.full(10, 6000)
    counts = round_shares(proportions, totals, rng)
    shares = proportions * totals[:, None]
    np.testing.assert_array_equal(counts.sum(axis=1), totals)
    assert (np.abs(counts - shares) < 1 + 1e-6).all() and (np.abs(counts.sum(0) - shares.sum(0)) < 1 + 1e-6).all()


@pytest.mark.parametrize("shape", [(3, 9), (9, 3)])  # pairs of classes trade; pairs of clients trade
def test_each_count_is_its_share_on_average(shape):
    """The pair trades once rounded up the entries they met first, whatever their fractions: on a 3 x 9 matrix a mean
    count was 0.36 of an example off its share over 6,000 draws. Every step now keeps each entry's expectation."""
    rng = np.random.default_rng(1)
    proportions = rng.dirichlet(np.ones(shape[1]), size=shape[0])
    totals = np.full(shape[0], 7)
    shares = proportions / proportions.sum(axis=1, keepdims=True) * totals[:, None]
    draws = 1500
    mean = sum(round_shares(proportions, totals, np.random.default_rng(seed)) for seed in range(draws)) / draws
    assert np.abs(mean - shares).max() < 0.08  # six standard errors of a mean of 1,500 counts that vary by one
