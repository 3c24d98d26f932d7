"""Strategy.fold_many: several updates in one pass, bit for bit the one-by-one folds in the same order; an update
that fails its checks is refused alone and the rest of its group still counts."""

from __future__ import annotations

import numpy as np
import pytest

from fedpar.aggregation import FedAvg, FedAvgM, FoldConfig, FoldItem, Median
from fedpar.aggregation.accumulator import TORCH_INLINE_ELEMENTS

# sizes off every block boundary, one array longer than a torch block, one with float64 and one with integer values
SHAPES = [(301, 97), (5,), (TORCH_INLINE_ELEMENTS + 4096 + 3,), (1,)]
DTYPES = [np.float32, np.float32, np.float64, np.int32]


def _updates(k: int, seed: int = 0) -> list[FoldItem]:
    """``k`` clients' updates with non-integer weights (so the total weight's rounding shows too)."""
    rng = np.random.default_rng(seed)
    return [FoldItem([(rng.standard_normal(s) * 50).astype(d) for s, d in zip(SHAPES, DTYPES)],
                     float(rng.uniform(0.5, 40)), f"c{j}") for j in range(k)]


def _bits(arrays) -> list[bytes]:
    return [a.tobytes() for a in arrays]


def _one_by_one(strategy, items, global_w, skip=()) -> list[np.ndarray]:
    strategy.begin_round(1, global_w)
    for j, item in enumerate(items):
        if j not in skip:
            strategy.fold(item.update, item.num_examples, item.client_id, known_finite=True)
    return strategy.finish()[0]


@pytest.mark.parametrize("block", [0, 4096 + 17], ids=["kernel-blocks", "odd-blocks"])
@pytest.mark.parametrize("accumulate", ["float32", "float64"])
@pytest.mark.parametrize("backend", ["blas", "numpy", "torch"])
def test_a_grouped_fold_is_bit_for_bit_the_one_by_one_fold(backend, accumulate, block):
    items = _updates(11)
    global_w = items[0].update
    config = FoldConfig(accumulate_dtype=accumulate, backend=backend, num_workers=2, min_parallel_elements=1,
                        block_elements=block, group_size=4)
    grouped = FedAvgM(server_momentum=0.5, fold_config=config)  # the server update runs on what was folded
    grouped.begin_round(1, global_w)
    assert grouped.group_size == 4
    assert grouped.fold_many(items[:2]) == [None, None]
    assert grouped.fold_many(items[2:], known_finite=True) == [None] * 9  # passes of 4, 4 and 1
    acc = grouped.partial_sum()
    assert (acc.count, len(acc.shards)) == (11, 2)
    sums, total = _bits(acc.buffers.values()), acc.total_weight
    got = grouped.finish()[0]

    single = FedAvgM(server_momentum=0.5, fold_config=config)
    single.begin_round(1, global_w)
    for item in items:
        single.fold(*item[:4], known_finite=True)
    assert _bits(single.partial_sum().buffers.values()) == sums and single.partial_sum().total_weight == total
    assert _bits(single.finish()[0]) == _bits(got)


def test_a_group_refuses_a_non_finite_update_and_a_duplicate_alone_and_folds_the_rest():
    good = _updates(6, seed=1)
    bad = [a.copy() for a in good[2].update]
    bad[2][TORCH_INLINE_ELEMENTS + 7] = np.inf
    items = good[:2] + [good[2]._replace(update=bad)] + good[3:] + [good[0]._replace(update=good[1].update)]
    config = FoldConfig(group_size=3, num_workers=2, min_parallel_elements=1)
    strategy = FedAvg(config)
    strategy.begin_round(1, good[1].update)
    errors = strategy.fold_many(items)
    assert [e is None for e in errors] == [True, True, False, True, True, True, False]
    assert "'c2' contains NaN or Inf" in str(errors[2]) and "client 'c0' already contributed" in str(errors[6])
    assert strategy.partial_sum().count == 5
    assert strategy.fold_many([good[2]]) == [None]  # the refused client may still send a good update
    order = [good[j] for j in (0, 1, 3, 4, 5, 2)]
    assert _bits(strategy.finish()[0]) == _bits(_one_by_one(FedAvg(config), order, good[1].update))


@pytest.mark.parametrize("make", [lambda: Median(), lambda: _capped()], ids=["median", "share-cap"])
def test_strategies_that_cannot_group_fold_one_by_one(make):
    items = _updates(5, seed=2)
    bad = [a.copy() for a in items[3].update]
    bad[0][0, 0] = np.nan
    items[3] = items[3]._replace(update=bad)
    strategy = make()
    assert strategy.group_size == 1
    strategy.begin_round(1, items[0].update)
    errors = strategy.fold_many(items)
    assert [e is None for e in errors] == [True, True, True, False, True]
    assert _bits(strategy.finish()[0]) == _bits(_one_by_one(make(), items, items[0].update, skip={3}))


def _capped() -> FedAvg:
    strategy = FedAvg()
    strategy.cap_shares(0.4)
    return strategy


def test_fold_many_needs_an_open_round():
    with pytest.raises(RuntimeError, match="no open round"):
        FedAvg().fold_many(_updates(1))
