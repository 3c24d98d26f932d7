"""fedavg(): weighted mean against numpy's reference, streaming == batch, sharding exactness, and input errors."""

import threading

import numpy as np
import pytest

from fedpar.aggregation import FoldConfig, ShapesAndDtypes, WeightedSum, fedavg


def make_results(k, shapes=((7, 5), (5,), (3, 4, 2)), dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return [([rng.standard_normal(s).astype(dtype) for s in shapes], int(rng.integers(1, 50))) for _ in range(k)]


def reference(results):
    w = np.array([n for _, n in results], np.float64)
    return [np.average(np.stack([np.asarray(a[i], np.float64) for a, _ in results]), axis=0, weights=w)
            for i in range(len(results[0][0]))]


@pytest.mark.parametrize("accumulate", ["float32", "float64"])
@pytest.mark.parametrize("backend", ["blas", "numpy", "torch"])
def test_matches_weighted_average(accumulate, backend):
    results = make_results(13)
    out = fedavg(results, FoldConfig(accumulate_dtype=accumulate, backend=backend))
    tol = 1e-6 if accumulate == "float32" else 1e-7  # float64 then rounded to float32 output
    for o, r, (a, _) in zip(out, reference(results), [(results[0][0][i], 0) for i in range(3)]):
        assert o.dtype == np.float32 and o.shape == a.shape
        np.testing.assert_allclose(o, r, rtol=tol, atol=tol)


def test_streaming_iterator_equals_batch_list_and_uses_input_dtypes():
    results = [([np.asarray(a[0], np.float64), np.asarray(a[1], np.float16), np.arange(5) * (i + 1)], n)
               for i, (a, n) in enumerate(make_results(9))]
    batch = fedavg(results)
    stream = fedavg(iter(results))
    gen = fedavg((r for r in results))
    ref = reference(results)
    for b, s, g in zip(batch, stream, gen):
        assert b.dtype == s.dtype == g.dtype
        np.testing.assert_array_equal(s, g)
        np.testing.assert_array_equal(b, s)  # float64 accumulation for float64/int arrays; float16 rounds the same
    assert batch[0].dtype == np.float64 and batch[1].dtype == np.float16
    np.testing.assert_allclose(batch[0], ref[0], rtol=1e-12)
    np.testing.assert_allclose(batch[1].astype(np.float64), ref[1], rtol=2e-3, atol=2e-3)
    assert batch[2].dtype == np.int64  # integer arrays are averaged in float64 and rounded to nearest
    np.testing.assert_array_equal(batch[2], np.rint(ref[2]).astype(np.int64))


def test_equal_weights_of_constant_models_is_exact():
    results = [([np.full(10, float(v), np.float32)], 3) for v in (1, 2, 3, 6)]
    np.testing.assert_array_equal(fedavg(results)[0], np.full(10, 3.0, np.float32))


@pytest.mark.parametrize("backend", ["blas", "numpy", "torch"])
def test_sharded_equals_unsharded_in_float64(backend):
    rng = np.random.default_rng(3)
    shapes = [(1000, 37), (5,), (333, 301), (1,), (20001,)]
    results = [([rng.standard_normal(s) for s in shapes], float(rng.uniform(0.5, 9))) for _ in range(6)]
    one = FoldConfig(accumulate_dtype="float64", num_workers=1, backend=backend)
    sharded = FoldConfig(accumulate_dtype="float64", num_workers=3, min_parallel_elements=1,
                         block_elements=4096 + 17, backend=backend, group_size=4)
    a, b = fedavg(iter(results), one), fedavg(iter(results), sharded)
    for x, y in zip(a, b):
        if backend == "blas":  # OpenBLAS's axpy cuts a range into its threads' parts and each into a fused
            # multiply-add body and a tail, so a shard boundary can move an element from one to the other (on AMD EPYC
            # with OPENBLAS_CORETYPE=Haswell: 1 ulp on 36 of 100,233 elements): the same sum to rounding
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-13)
        else:
            np.testing.assert_array_equal(x, y)
    acc = WeightedSum(ShapesAndDtypes.of(results[0][0]), sharded)
    assert len(acc.shards) == 3 and sum(e - s for sh in acc.shards for _, s, e in sh) == sum(np.prod(s) for s in shapes)


def test_grouped_fold_equals_one_by_one_in_float64():
    results = make_results(11, dtype=np.float64, seed=5)
    grouped = fedavg(results, FoldConfig(accumulate_dtype="float64", group_size=4))
    single = fedavg(results, FoldConfig(accumulate_dtype="float64", group_size=1))
    for x, y in zip(grouped, single):
        np.testing.assert_array_equal(x, y)


def test_concurrent_folds_from_threads_count_every_update():
    layout = ShapesAndDtypes.of([np.zeros(300_000, np.float64)])
    acc = WeightedSum(layout, FoldConfig(accumulate_dtype="float64", num_workers=2, min_parallel_elements=1))
    vals = np.arange(1, 33, dtype=np.float64)

    def worker(v):
        acc.fold([np.full(300_000, v)], 2.0)

    threads = [threading.Thread(target=worker, args=(v,)) for v in vals]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert acc.count == 32 and acc.total_weight == 64.0
    np.testing.assert_array_equal(acc.mean()[0], np.full(300_000, vals.mean()))


def test_errors_say_what_is_wrong():
    good = [np.zeros((2, 3), np.float32), np.zeros(4, np.float32)]
    with pytest.raises(ValueError, match="at least one"):
        fedavg([])
    with pytest.raises(ValueError, match="at least one"):
        fedavg(iter([]))
    with pytest.raises(ValueError, match="total weight"):
        fedavg([(good, 0), (good, 0)])
    with pytest.raises(ValueError, match="shape"):
        fedavg([(good, 1), ([np.zeros((3, 2), np.float32), good[1]], 1)])
    with pytest.raises(ValueError, match="has 1 arrays but the model has 2"):
        fedavg(iter([(good, 1), (good[:1], 1)]))
    with pytest.raises(ValueError, match="dtype"):
        fedavg([(good, 1), ([good[0].astype(np.float64), good[1]], 1)])
    bad = [good[0].copy(), good[1].copy()]
    bad[1][2] = np.nan
    with pytest.raises(ValueError, match="NaN/Inf"):
        fedavg(iter([(good, 1), (bad, 1)]))
    bad[1][2] = np.inf
    with pytest.raises(ValueError, match="NaN/Inf"):
        fedavg([(good, 1), (bad, 2)])
    with pytest.raises(ValueError, match=">= 0"):
        fedavg([(good, -1)])
    with pytest.raises(ValueError, match="pair"):
        fedavg(iter([(good, 1, 2)]))


def test_weighted_sum_fold_rejects_nonfinite_without_touching_the_sum():
    acc = WeightedSum(ShapesAndDtypes.of([np.zeros(10, np.float32)]))
    acc.fold([np.ones(10, np.float32)], 1)
    x = np.ones(10, np.float32)
    x[9] = np.inf
    with pytest.raises(ValueError, match="not counted"):
        acc.fold([x], 5)
    assert acc.count == 1 and acc.total_weight == 1.0
    np.testing.assert_array_equal(acc.mean()[0], np.ones(10, np.float32))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_all_finite_finds_every_nan_and_inf_wherever_it_sits(dtype):
    from fedpar.aggregation.accumulator import all_finite

    for n in (1, 2, 7, 16, 17, 33, 64, 129, 4097, 100_003):
        base = np.random.default_rng(n).standard_normal(n).astype(dtype)
        assert all_finite(base)
        for p in sorted({0, n // 3, n // 2, n - 1}):
            for v in (np.nan, np.inf, -np.inf):
                x = base.copy()
                x[p] = v
                assert not all_finite(x), (n, p, v)
                assert not all_finite(x[::-1])  # strided views take the numpy path
    big = np.full(10, np.finfo(dtype).max / 2, dtype)  # the fast sum overflows: a false alarm, settled exactly
    assert all_finite(big)
