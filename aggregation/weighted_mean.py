"""``fedavg()``, FedAvg as one plain function: the weighted mean of ``(arrays, num_examples)`` results.

The FedAvg strategy the coordinator runs round by round is aggregation/fedavg_strategies.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from fedpar.aggregation.accumulator import FoldConfig, ShapesAndDtypes, WeightedSum, all_finite


def fedavg(results: Iterable[tuple[Sequence[np.ndarray], int]], config: FoldConfig | None = None) -> list[np.ndarray]:
    """Weighted mean of the results' arrays by ``num_examples``, returned in the input dtypes.

    An iterator is consumed one result at a time (extra memory: one accumulator, about one model).
    A list/tuple is already in memory, so it is folded ``config.group_size`` results per pass over the
    accumulator, which cuts memory traffic. NaN/Inf anywhere in the inputs raises ``ValueError``
    (checked once on the result, so inputs are read only once).
    """
    config = config or FoldConfig()
    if isinstance(results, Sequence):
        if not results:
            raise ValueError("fedavg needs at least one (arrays, num_examples) result; got none")
        acc = WeightedSum(ShapesAndDtypes.of(results[0][0]), config)
        acc.fold_many(results, check_finite=False)
    else:
        acc = None
        for k, item in enumerate(results):
            arrays, num_examples = _unpack(item, k)
            if acc is None:
                acc = WeightedSum(ShapesAndDtypes.of(arrays), config)
            acc.fold(arrays, num_examples, check_finite=False, who=f"result {k}")
        if acc is None:
            raise ValueError("fedavg needs at least one (arrays, num_examples) result; got none")
    out = acc.mean(inplace=True)
    for i, a in enumerate(out):
        if not all_finite(a):
            raise ValueError(f"the average of array {i} is not finite: some result contains NaN/Inf "
                             "(or values so large that their weighted sum overflows); drop or clip that update")
    return out


def _unpack(item: object, k: int) -> tuple[Sequence[np.ndarray], int]:
    """Split one ``(arrays, num_examples)`` result, with a helpful error if it is malformed."""
    try:
        arrays, num_examples = item  # type: ignore[misc]
    except (TypeError, ValueError):
        raise ValueError(f"result {k} must be a pair (list_of_arrays, num_examples)") from None
    return arrays, num_examples
