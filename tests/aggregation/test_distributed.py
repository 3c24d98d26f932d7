"""Two aggregator ranks (one spawned gloo group) combine partial sums by all-reduce == one process."""

import sys
from pathlib import Path

import numpy as np
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import the rank body by module name
import aggregation_dist_checks as checks  # noqa: E402

from fedpar.aggregation import FedAvg, FoldConfig, fedavg  # noqa: E402


def test_two_rank_all_reduce_equals_single_process(tmp_path):
    mp.spawn(checks.rank_main, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz", allow_pickle=False)) for r in range(2)]
    for key in ranks[0]:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key])  # every rank holds the same global model
    cases = {"f64_dyadic": ("float64", np.float64, True, 0.0), "f64_random": ("float64", np.float64, False, 1e-13),
             "f32_random": ("float32", np.float32, False, 2e-6)}
    for name, (acc_dtype, dtype, dyadic, tol) in cases.items():
        results = checks.cohort(dtype, dyadic)
        single = fedavg(iter(results), FoldConfig(accumulate_dtype=acc_dtype, num_workers=1))
        assert int(ranks[0][f"{name}.count"]) == checks.K
        assert float(ranks[0][f"{name}.total"]) == sum(n for _, n in results)
        for i, want in enumerate(single):
            got = ranks[0][f"{name}.{i}"]
            assert got.dtype == want.dtype
            if tol == 0.0:
                np.testing.assert_array_equal(got, want)  # exact: dyadic sums do not depend on order
            else:
                np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    results = checks.cohort(np.float32, False, seed=1)
    s = FedAvg()
    s.begin_round(1, [np.zeros(sh, np.float32) for sh in checks.SHAPES])
    for j, (u, n) in enumerate(results):
        s.fold(u, n, f"c{j}")
    single, _ = s.finish()
    assert float(ranks[0]["strategy.num_updates"]) == checks.K
    for i, want in enumerate(single):
        np.testing.assert_allclose(ranks[0][f"strategy.{i}"], want, rtol=2e-6, atol=2e-6)
        np.testing.assert_allclose(ranks[0][f"device.{i}"], want, rtol=2e-6, atol=2e-6)  # sums kept as tensors
