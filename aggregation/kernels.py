"""Inner loops of the weighted fold: ``acc += w * x`` (BLAS axpy, or numpy/torch over cache-sized blocks), and
shard planning.

Every kernel reads each update once and reads/writes the accumulator once per pass (the STREAM triad
pattern). When several updates are folded in one pass, the torch and numpy kernels keep each accumulator block in
cache while all of them are added, so accumulator traffic is paid once per group instead of once per update. Each
update's operations on each element are the same whatever its group, so a grouped fold is bit for bit the
one-by-one fold in the same order.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

NUMPY_BLOCK_ELEMENTS = 32768  # the numpy kernel's block (with its w * x scratch, in a core's L2)
# torch runs element-wise ops inline (no intra-op threads) below this many elements (at::internal::GRAIN_SIZE).
TORCH_INLINE_ELEMENTS = 32768
# Where the calling thread has one intra-op thread (every aggregator rank, and torchrun's processes), every op runs
# inline, and longer blocks cut the per-call overhead, which the pool's threads pay holding the GIL: 1 MiB of float32
# accumulator, a core's L2 here (measured, K=40 x 10M float32 in groups of 8 on 2 busy cores: 0.67-0.70 of the
# same numpy read against 0.43 with 32768).
TORCH_SERIAL_BLOCK_ELEMENTS = 1 << 18
# Where torch has several intra-op threads (a one-process coordinator), one thread folds and torch splits each add_
# over its own threads: no pool of ours on top (it would oversubscribe the cores, or, over blocks short enough to
# run inline, pay a Python call per 32768 elements). Measured, 24 x 10M float32 in groups of 8 on 2 quiet cores:
# 0.67 / 0.78 of the same numpy read with 2^18 / 2^20 blocks, against 0.48 for the pool over inline blocks.
TORCH_PARALLEL_BLOCK_ELEMENTS = 1 << 20

Segment = tuple[int, int, int]  # (array index, start, stop) within that array's flat view


def plan_shards(sizes: Sequence[int], num_shards: int) -> list[list[Segment]]:
    """Cut the concatenated flat parameter vector into ``num_shards`` near-equal contiguous ranges."""
    total = sum(sizes)
    num_shards = max(1, min(num_shards, total)) if total else 1
    bounds = [total * i // num_shards for i in range(num_shards + 1)]
    shards: list[list[Segment]] = []
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        segs: list[Segment] = []
        for i, size in enumerate(sizes):
            a_lo, a_hi = offsets[i], offsets[i] + size
            s, e = max(lo, a_lo), min(hi, a_hi)
            if s < e:
                segs.append((i, s - a_lo, e - a_lo))
        shards.append(segs)
    return shards


def fold_block_numpy(acc: np.ndarray, xs: Sequence[np.ndarray], ws: Sequence[float],
                     tmp: np.ndarray, block: int) -> None:
    """``acc += sum_k ws[k] * xs[k]`` on 1-D arrays, one cache-sized block at a time, in the accumulator dtype;
    ``block`` 0 is NUMPY_BLOCK_ELEMENTS (``tmp`` holds a block)."""
    block = block or NUMPY_BLOCK_ELEMENTS
    n = acc.shape[0]
    scalars = [acc.dtype.type(w) for w in ws]
    for s in range(0, n, block):
        e = min(s + block, n)
        a = acc[s:e]
        t = tmp[: e - s]
        for x, w in zip(xs, scalars):
            np.multiply(x[s:e], w, out=t)
            np.add(a, t, out=a)


def fold_block_torch(acc: np.ndarray, xs: Sequence[np.ndarray], ws: Sequence[float],
                     tmp: np.ndarray, block: int) -> None:
    """Same as :func:`fold_block_numpy` with torch's fused ``acc.add_(x, alpha=w)`` on shared-memory views (the
    default kernel: each call runs inline and without the GIL, so the pool's threads fold their shards side by side,
    and a group's updates are added to each block while it is in cache)."""
    del tmp
    block = torch_block(block)
    n = acc.shape[0]
    at = torch.from_numpy(acc)
    xts = [torch.from_numpy(x) for x in xs]
    for s in range(0, n, block):
        e = min(s + block, n)
        a = at[s:e]
        for x, w in zip(xts, ws):
            a.add_(x[s:e], alpha=w)


def torch_block(block: int, pooled: bool = False) -> int:
    """The torch kernel's block: ``block``, or by default TORCH_SERIAL_BLOCK_ELEMENTS where torch runs ops on one
    intra-op thread and TORCH_PARALLEL_BLOCK_ELEMENTS where it splits them itself (:func:`torch_splits_ops`); on
    the threads of a pool of ours (``pooled``) with such a torch, at most TORCH_INLINE_ELEMENTS, which torch runs
    inline (no oversubscribed cores)."""
    if not torch_splits_ops():
        return block or TORCH_SERIAL_BLOCK_ELEMENTS
    if pooled:
        return min(block or TORCH_INLINE_ELEMENTS, TORCH_INLINE_ELEMENTS)
    return block or TORCH_PARALLEL_BLOCK_ELEMENTS


def torch_splits_ops() -> bool:
    """Whether torch spreads each element-wise op over several intra-op threads in this process (the torch kernel
    then folds on one thread, with no pool of ours: aggregation/accumulator.py)."""
    return torch.get_num_threads() > 1


@functools.lru_cache(maxsize=None)
def blas_axpy(dtype: np.dtype):
    """scipy's BLAS axpy for float32/float64 (None for other dtypes); the first call imports scipy.linalg (about
    1 s), which an accumulator pays when it is made, not in its first fold."""
    from scipy.linalg import blas

    return {"float32": blas.saxpy, "float64": blas.daxpy}.get(np.dtype(dtype).name)


def fold_block_blas(acc: np.ndarray, xs: Sequence[np.ndarray], ws: Sequence[float],
                    tmp: np.ndarray, block: int) -> None:
    """Same sum with BLAS ``axpy``: one fused pass per update over the whole range, multithreaded by OpenBLAS
    (measured on idle cores at about 0.85x the machine's 2-thread read bandwidth; on cores other processes keep busy,
    0.14-0.31x against 0.34-0.51x for the torch kernel, as each call waits for OpenBLAS's threads). No cache blocking:
    a group's updates each pass over the whole accumulator. Updates whose dtype differs from the accumulator's take
    the numpy kernel."""
    axpy = blas_axpy(acc.dtype)
    for x, w in zip(xs, ws):
        if axpy is None or x.dtype != acc.dtype or not x.flags.c_contiguous or not acc.flags.c_contiguous:
            fold_block_numpy(acc, [x], [w], tmp, block)
            continue
        out = axpy(x, acc, a=w)
        if not np.shares_memory(out, acc):  # f2py copied instead of updating in place: write it back
            acc[...] = out


KERNELS = {"numpy": fold_block_numpy, "torch": fold_block_torch, "blas": fold_block_blas}
