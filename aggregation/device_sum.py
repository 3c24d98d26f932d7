"""A running weighted sum that lives on a torch device: under NCCL, an aggregator rank's partial sum in its GPU's
memory, where the all-reduce finds it without a copy.

Each update is copied into a pinned host staging buffer (one per input dtype, the size of the model), moved to the
device with one non-blocking copy, checked for NaN/Inf there, and folded with one fused multiply-add per tensor
(``torch.Tensor.add_(x, alpha=w)``). The mean comes back to the host as numpy arrays. Same interface as
:class:`fedpar.aggregation.accumulator.WeightedSum` (strategies take either through :func:`weighted_sum`); on a CPU
device it runs the same code without pinning, which is how it is tested where there is no GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from fedpar.aggregation.accumulator import FoldConfig, check_averageable, check_weight
from fedpar.aggregation.arrays import ShapesAndDtypes, accumulate_dtype_for, all_finite, cast_like


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype)).dtype


class DeviceWeightedSum:
    """Running ``sum_k w_k * x_k`` and ``sum_k w_k`` on ``config.device``; device memory is one model in the
    accumulation dtypes plus one update, host memory one pinned update."""

    def __init__(self, shapes: ShapesAndDtypes, config: FoldConfig):
        """A zeroed accumulator for ``shapes`` on ``config.device``."""
        self.shapes, self.config = shapes, config
        self.device = torch.device(config.device)
        self.acc_dtypes = [accumulate_dtype_for(d, config.accumulate_dtype) for d in shapes.dtypes]
        sizes = shapes.sizes
        self.buffers: dict[str, torch.Tensor] = {}
        for dt in sorted({d.name for d in self.acc_dtypes}):
            n = sum(s for s, d in zip(sizes, self.acc_dtypes) if d.name == dt)
            self.buffers[dt] = torch.zeros(n, dtype=_torch_dtype(np.dtype(dt)), device=self.device)
        self.views = self._cut(self.buffers, self.acc_dtypes)
        pin = self.device.type == "cuda"
        in_dtypes = [np.dtype(d) for d in shapes.dtypes]
        self._staging = {dt: torch.empty(sum(s for s, d in zip(sizes, in_dtypes) if d.name == dt),
                                         dtype=_torch_dtype(np.dtype(dt)), pin_memory=pin)
                         for dt in sorted({d.name for d in in_dtypes})}
        self._scratch = {dt: torch.empty_like(t, device=self.device) for dt, t in self._staging.items()}
        self._host_views = self._cut(self._staging, in_dtypes)
        self._device_views = self._cut(self._scratch, in_dtypes)
        self.total_weight = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def _cut(self, flat: dict[str, torch.Tensor], dtypes: Sequence[np.dtype]) -> list[torch.Tensor]:
        """One view per array of the model into the flat buffer of its dtype."""
        used = {dt: 0 for dt in flat}
        views = []
        for size, d in zip(self.shapes.sizes, dtypes):
            views.append(flat[d.name][used[d.name]: used[d.name] + size])
            used[d.name] += size
        return views

    def reset(self) -> None:
        """Zero the sum so the accumulator can serve another round."""
        with self._lock:
            for b in self.buffers.values():
                b.zero_()
            self.total_weight = 0.0
            self.count = 0

    def all_finite(self, flat_items: Sequence[Sequence[np.ndarray]]) -> bool:
        """True if every array of every item is free of NaN/Inf (on the host, as WeightedSum checks)."""
        return all(all_finite(x) for xs in flat_items for x in xs)

    def _to_device(self, flat: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """``flat`` through the pinned staging buffers into the device scratch; the device views of it."""
        for host, x in zip(self._host_views, flat):
            host.numpy()[...] = x
        for dt, staged in self._staging.items():
            self._scratch[dt].copy_(staged, non_blocking=True)
        return self._device_views

    def fold(self, arrays: Sequence[np.ndarray], weight: float, check_finite: bool = True,
             who: str = "update") -> None:
        """Add ``weight * arrays``; with ``check_finite`` an update holding NaN/Inf is rejected untouched."""
        w = check_weight(weight)
        flat = [np.ravel(a) for a in self.shapes.check(arrays, who)]
        with self._lock:  # one staging buffer: one update at a time
            xs = self._to_device(flat)
            if check_finite and not all(bool(torch.isfinite(x).all()) for x in xs if x.is_floating_point()):
                raise ValueError(f"{who} contains NaN or Inf values; it was not counted")
            for acc, x in zip(self.views, xs):
                acc.add_(x.to(acc.dtype), alpha=w)
            self.total_weight += w
            self.count += 1

    def fold_many(self, items: Sequence[tuple[Sequence[np.ndarray], float]], check_finite: bool = True) -> None:
        """Fold several updates, one after the other."""
        for j, (arrays, weight) in enumerate(items):
            self.fold(arrays, weight, check_finite, who=f"update {j}")

    def fold_each(self, items: Sequence[tuple[Sequence[np.ndarray], float, str]],
                  check_finite: bool = True) -> list[ValueError | None]:
        """Fold several (arrays, weight, who) updates one after the other (each crosses to the device through the
        one staging buffer; the device's memory is not what bounds the fold), leaving out alone each one that fails
        its checks; per item, None (added) or the ValueError that refused it."""
        errors: list[ValueError | None] = []
        for arrays, weight, who in items:
            try:
                self.fold(arrays, weight, check_finite, who)
                errors.append(None)
            except ValueError as exc:
                errors.append(exc)
        return errors

    def mean(self, inplace: bool = False) -> list[np.ndarray]:
        """The weighted mean in the input dtypes, on the host; ``inplace`` divides the accumulator itself."""
        check_averageable(self.count, self.total_weight)
        out = []
        for view, shape, dtype in zip(self.views, self.shapes.shapes, self.shapes.dtypes):
            avg = view.div_(self.total_weight) if inplace else view / self.total_weight
            out.append(cast_like(avg.cpu().numpy(), dtype).reshape(shape))
        return out


def weighted_sum(shapes: ShapesAndDtypes, config: FoldConfig):
    """The running sum ``config`` asks for: on the host (numpy, BLAS) or on a torch device."""
    from fedpar.aggregation.accumulator import WeightedSum

    return WeightedSum(shapes, config) if config.device == "host" else DeviceWeightedSum(shapes, config)
