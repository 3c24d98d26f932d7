"""The robust strategies' memory notes are exact: what finish() allocates, measured with tracemalloc."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from fedpar.aggregation import Krum, Median, MultiKrum, TrimmedMean

K = 4
SCRATCH = 1 << 20  # a small chunk budget, so the model-sized outputs stand out from the scratch blocks


def _finish_peak(strategy, shapes):
    """Bytes allocated at the peak of ``finish`` beyond what was live before it, and the float32 model's bytes."""
    rng = np.random.default_rng(0)
    strategy.begin_round(1, [np.zeros(s, np.float32) for s in shapes])
    for j in range(K):
        strategy.fold([rng.standard_normal(s).astype(np.float32) for s in shapes], 10 + j, f"c{j}")
    strategy._store.scratch_bytes = SCRATCH
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        strategy.finish()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return peak, 4 * sum(int(np.prod(s)) for s in shapes)


def _scratch_bound():
    """At most 3 K x chunk float64 blocks (module docstring), plus a little bookkeeping."""
    columns = max(1024, SCRATCH // (8 * K))
    return 3 * K * columns * 8 + (256 << 10)


@pytest.mark.parametrize("cls", [Median, TrimmedMean])
def test_coordinatewise_rules_add_a_float64_model_and_the_new_model(cls):
    assert "float64 output of the model size" in cls.memory_note
    params = 400_000
    peak, model = _finish_peak(cls(), [(params // 2,), (params // 4,), (params // 4,)])
    float64_model = 8 * params
    assert float64_model <= peak <= float64_model + model + _scratch_bound()


@pytest.mark.parametrize("cls", [Krum, MultiKrum])
def test_krum_adds_two_float64_copies_of_the_largest_tensor_and_the_new_model(cls):
    assert "16 bytes x the largest tensor" in cls.memory_note
    params = 400_000
    peak, model = _finish_peak(cls(), [(params,)])  # one tensor: two model-sized float64 arrays
    assert 16 * params <= peak <= 16 * params + model + _scratch_bound()
    largest = params // 2
    peak, model = _finish_peak(cls(), [(largest,), (params // 4,), (params // 4,)])
    assert 16 * largest <= peak <= 16 * largest + model + _scratch_bound()
