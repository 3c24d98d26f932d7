"""The running sum kept on a torch device (DeviceWeightedSum) folds what the host sum folds:
run on the CPU device here, and on the GPU wherever there is one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedpar.aggregation import FedAvg, FoldConfig
from fedpar.aggregation.accumulator import DeviceWeightedSum, ShapesAndDtypes, WeightedSum

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _updates(k: int = 6):
    rng = np.random.default_rng(3)
    return [([rng.normal(size=(5, 7)).astype(np.float32), rng.integers(0, 9, 4).astype(np.int64)], float(i + 1))
            for i in range(k)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_device_sum_folds_what_the_host_sum_folds(device, dtype):
    ups = _updates()
    shapes = ShapesAndDtypes.of(ups[0][0])
    host, dev = WeightedSum(shapes, FoldConfig(accumulate_dtype=dtype)), \
        DeviceWeightedSum(shapes, FoldConfig(accumulate_dtype=dtype, device=device))
    for arrays, w in ups[:3]:
        host.fold(arrays, w)
        dev.fold(arrays, w)
    dev.fold_many(ups[3:])
    host.fold_many(ups[3:])
    for a, b in zip(host.mean(), dev.mean(inplace=True)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=0 if dtype == "float64" else 1e-6, atol=1e-6)
    assert (dev.count, dev.total_weight) == (host.count, host.total_weight) == (6, 21.0)


@pytest.mark.parametrize("device", DEVICES)
def test_an_update_with_nan_is_refused_and_leaves_the_device_sum_untouched(device):
    ups = _updates(2)
    dev = DeviceWeightedSum(ShapesAndDtypes.of(ups[0][0]), FoldConfig(device=device))
    dev.fold(*ups[0])
    before = [v.clone() for v in dev.views]
    bad = [ups[1][0][0].copy(), ups[1][0][1]]
    bad[0][2, 3] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        dev.fold(bad, 1.0)
    assert dev.count == 1 and all(torch.equal(a, b) for a, b in zip(before, dev.views))
    dev.reset()
    assert dev.count == 0 and all(not v.any() for v in dev.views)


def test_a_strategy_takes_the_device_sum_from_its_fold_config():
    ups = _updates()
    results = []
    for config, kind in ((FoldConfig(), WeightedSum), (FoldConfig(device="cpu"), DeviceWeightedSum)):
        s = FedAvg(config)
        s.begin_round(1, [np.zeros_like(a) for a in ups[0][0]])
        assert type(s.partial_sum()) is kind
        for j, (arrays, w) in enumerate(ups):
            s.fold(arrays, w, f"c{j}")
        results.append(s.finish()[0])
    for a, b in zip(*results):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
