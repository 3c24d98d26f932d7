"""Streaming weighted sum of model updates: the running state behind FedAvg and the FedOpt family."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from fedpar.aggregation.kernels import (KERNELS, NUMPY_BLOCK_ELEMENTS, Segment, blas_axpy, plan_shards,
                                       torch_block, torch_splits_ops)
from fedpar.aggregation.arrays import ShapesAndDtypes, accumulate_dtype_for, all_finite, cast_like, checked_by_blas


@dataclass(frozen=True)
class FoldConfig:
    """How a weighted sum is accumulated."""

    accumulate_dtype: str = "float32"  # "float32" or "float64"; float64 inputs always accumulate in float64
    num_workers: int = 0  # threads folding shards side by side; 0 = one per CPU core
    min_parallel_elements: int = 1 << 20  # models smaller than this are folded on the calling thread
    # elements per cache block (per worker, x accumulator itemsize); 0: the kernel's own (aggregation/kernels.py)
    block_elements: int = 0
    # "torch" (fused add_ over cache blocks, on the pool's threads), "numpy" (multiply+add through a cached block),
    # "blas" (axpy over whole shards, each call threaded by OpenBLAS: fast on idle cores, 2-3x slower than torch on
    # busy ones, where every call waits for OpenBLAS's threads)
    backend: str = "torch"
    group_size: int = 8  # updates folded per pass over the accumulator when several are at hand
    # "host": numpy/BLAS in host memory (WeightedSum); a torch device, e.g. "cuda:0" (an NCCL aggregator rank's
    # GPU), holds the sum there instead (aggregation/device_sum.py; "cpu" runs that path on the host, for tests)
    device: str = "host"

    def __post_init__(self) -> None:
        """Reject unknown settings early."""
        accumulate_dtype_for(np.dtype(np.float32), self.accumulate_dtype)
        if self.backend not in KERNELS:
            raise ValueError(f"backend must be one of {sorted(KERNELS)}, got {self.backend!r}")
        if self.num_workers < 0 or self.block_elements < 0 or self.group_size < 1:
            raise ValueError("num_workers and block_elements must be >= 0, group_size >= 1")

    def workers(self) -> int:
        """The resolved number of worker threads."""
        return self.num_workers or os.cpu_count() or 1


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(n: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``n`` fold workers (shared by every accumulator)."""
    with _POOLS_LOCK:
        if n not in _POOLS:
            _POOLS[n] = ThreadPoolExecutor(n, thread_name_prefix="fedpar-fold")
        return _POOLS[n]


def check_weight(weight: float) -> float:
    """Return ``weight`` as a float after checking it is finite and non-negative."""
    try:
        w = float(weight)
    except (TypeError, ValueError):
        raise ValueError(f"num_examples (the update weight) must be a number, got {type(weight).__name__}") from None
    if not np.isfinite(w) or w < 0:
        raise ValueError(f"num_examples (the update weight) must be a finite number >= 0, got {weight!r}")
    return w


def check_averageable(count: int, total_weight: float) -> None:
    """ValueError unless ``count`` updates of ``total_weight`` in all can be averaged."""
    if count == 0:
        raise ValueError("no updates were folded; cannot average an empty set of results")
    if total_weight <= 0:
        raise ValueError("the total weight (sum of num_examples) is zero; at least one update needs num_examples > 0")


class WeightedSum:
    """Running ``sum_k w_k * x_k`` and ``sum_k w_k`` over updates of one shape and dtype list; memory is one model.

    The accumulator is one flat buffer per accumulation dtype; each array of the model is a view into
    it. Large models are cut into contiguous shards folded side by side by a thread pool (numpy and
    torch release the GIL in their loops). ``fold`` is thread-safe.
    """

    def __init__(self, shapes: ShapesAndDtypes, config: FoldConfig | None = None) -> None:
        """Allocate a zeroed accumulator for ``shapes``."""
        self.shapes = shapes
        self.config = config or FoldConfig()
        self.acc_dtypes = [accumulate_dtype_for(d, self.config.accumulate_dtype) for d in shapes.dtypes]
        self.buffers: dict[str, np.ndarray] = {}
        sizes = shapes.sizes
        for dt in sorted({d.name for d in self.acc_dtypes}):
            n = sum(s for s, d in zip(sizes, self.acc_dtypes) if d.name == dt)
            self.buffers[dt] = np.zeros(n, dtype=dt)
        self.views: list[np.ndarray] = []
        used = {dt: 0 for dt in self.buffers}
        for size, d in zip(sizes, self.acc_dtypes):
            self.views.append(self.buffers[d.name][used[d.name]: used[d.name] + size])
            used[d.name] += size
        workers = self.config.workers()
        # torch with intra-op threads of its own splits each op itself: by default no pool of ours on top
        torch_kernel = self.config.backend == "torch"
        own_threads = torch_kernel and self.config.num_workers == 0 and torch_splits_ops()
        parallel = workers > 1 and shapes.num_elements >= self.config.min_parallel_elements and not own_threads
        self.shards: list[list[Segment]] = plan_shards(sizes, workers if parallel else 1)
        self._block = torch_block(self.config.block_elements, len(self.shards) > 1) if torch_kernel \
            else self.config.block_elements
        self.total_weight = 0.0
        self.count = 0
        self._lock = threading.Lock()
        # one scratch block per shard (the numpy kernel's w * x lands here and stays in cache)
        self._tmp_elements = self.config.block_elements or NUMPY_BLOCK_ELEMENTS
        self._tmp = [np.empty(self._tmp_elements * 8, dtype=np.uint8) for _ in self.shards]
        if self.config.backend == "blas":
            for dtype in self.acc_dtypes:
                blas_axpy(dtype)

    def reset(self) -> None:
        """Zero the sum so the accumulator can serve another round."""
        with self._lock:
            for b in self.buffers.values():
                b.fill(0)
            self.total_weight = 0.0
            self.count = 0

    def _run_shards(self, fn) -> list:
        """Run ``fn(shard_index)`` for every shard, on the pool when there are several."""
        if len(self.shards) == 1:
            return [fn(0)]
        return list(_pool(len(self.shards)).map(fn, range(len(self.shards))))

    def _flat_inputs(self, arrays: Sequence[np.ndarray], who: str) -> list[np.ndarray]:
        """Checked, flattened (view when contiguous) inputs."""
        return [np.ravel(a) for a in self.shapes.check(arrays, who)]

    def all_finite(self, flat_items: Sequence[Sequence[np.ndarray]]) -> bool:
        """True if every array of every item is free of NaN/Inf (checked shard by shard on the pool)."""
        if all(checked_by_blas(x) or x.size == 0 for xs in flat_items for x in xs):
            # BLAS asum runs on OpenBLAS's own threads: calling it from the pool as well oversubscribes the
            # cores (measured: 100 x 10M float32 took 0.20 s from the pool, 0.12 s called here).
            return all(all_finite(x) for xs in flat_items for x in xs)

        def check(k: int) -> bool:
            return all(all_finite(xs[i][s:e]) for xs in flat_items for i, s, e in self.shards[k])
        return all(self._run_shards(check))

    def _fold_flat(self, flat_items: Sequence[Sequence[np.ndarray]], weights: Sequence[float]) -> None:
        """Add ``sum_k weights[k] * flat_items[k]`` into the accumulator, shard by shard."""
        kernel = KERNELS[self.config.backend]
        block = self._block

        def fold_shard(k: int) -> None:
            for i, s, e in self.shards[k]:
                acc = self.views[i][s:e]
                tmp = self._tmp[k][: self._tmp_elements * acc.dtype.itemsize].view(acc.dtype)
                kernel(acc, [xs[i][s:e] for xs in flat_items], weights, tmp, block)

        self._run_shards(fold_shard)

    def check(self, arrays: Sequence[np.ndarray], weight: float, who: str = "update",
              check_finite: bool = True) -> tuple[list[np.ndarray], float]:
        """One update made ready to add: its flattened arrays and weight, after checking the weight, the shapes and
        dtypes and (with ``check_finite``) NaN/Inf; a ValueError says what is wrong."""
        w = check_weight(weight)
        flat = self._flat_inputs(arrays, who)
        if check_finite and not self.all_finite([flat]):
            raise ValueError(f"{who} contains NaN or Inf values; it was not counted")
        return flat, w

    def add(self, checked: Sequence[tuple[list[np.ndarray], float]]) -> None:
        """Add updates returned by :meth:`check`, in order, ``group_size`` per pass over the accumulator."""
        g = self.config.group_size
        with self._lock:
            for start in range(0, len(checked), g):
                group = checked[start: start + g]
                self._fold_flat([flat for flat, _ in group], [w for _, w in group])
                for _, w in group:  # one addition per update, as one-by-one folds add them
                    self.total_weight += w
                self.count += len(group)

    def fold(self, arrays: Sequence[np.ndarray], weight: float, check_finite: bool = True,
             who: str = "update") -> None:
        """Add ``weight * arrays``; with ``check_finite`` an update holding NaN/Inf is rejected untouched."""
        self.add([self.check(arrays, weight, who, check_finite)])

    def fold_many(self, items: Sequence[tuple[Sequence[np.ndarray], float]], check_finite: bool = True) -> None:
        """Fold several updates at once, ``group_size`` per pass over the accumulator (fewer memory passes); a
        ValueError for any of them leaves the sum untouched."""
        self.add([self.check(a, w, f"update {j}", check_finite) for j, (a, w) in enumerate(items)])

    def fold_each(self, items: Sequence[tuple[Sequence[np.ndarray], float, str]],
                  check_finite: bool = True) -> list[ValueError | None]:
        """Fold several (arrays, weight, who) updates in order, ``group_size`` per pass, leaving out alone each one
        that fails its checks; per item, None (added) or the ValueError that refused it. Bit for bit the sum of
        folding the added ones one by one in this order."""
        ready, errors = [], []
        for arrays, weight, who in items:
            try:
                ready.append(self.check(arrays, weight, who, check_finite))
                errors.append(None)
            except ValueError as exc:
                errors.append(exc)
        self.add(ready)
        return errors

    def mean(self, inplace: bool = False) -> list[np.ndarray]:
        """The weighted mean in the input dtypes; ``inplace`` divides the accumulator itself (it is then spent)."""
        check_averageable(self.count, self.total_weight)
        out = []
        for view, shape, dtype in zip(self.views, self.shapes.shapes, self.shapes.dtypes):
            total = view.dtype.type(self.total_weight)
            avg = np.divide(view, total, out=view) if inplace else view / total
            out.append(cast_like(avg, dtype).reshape(shape))
        return out
