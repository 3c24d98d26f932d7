"""Inner loops of the weighted fold: ``acc += w * x`` (BLAS axpy, or numpy/torch over cache-sized blocks), and
shard planning.

Both kernels read each update once and read/write the accumulator once per pass (the STREAM triad
pattern). When several updates are folded in one pass, each accumulator block stays in cache while all
of them are added, so accumulator traffic is paid once per group instead of once per update.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

# torch runs element-wise ops inline (no intra-op threads) below this many elements (at::internal::GRAIN_SIZE);
# the torch kernel stays under it so our own worker pool does not oversubscribe the cores.
TORCH_INLINE_ELEMENTS = 32768

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
    """``acc += sum_k ws[k] * xs[k]`` on 1-D arrays, one cache-sized block at a time, in the accumulator dtype."""
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
    """Same as :func:`fold_block_numpy` with torch's fused ``acc.add_(x, alpha=w)`` on shared-memory views."""
    del tmp
    block = min(block, TORCH_INLINE_ELEMENTS)
    n = acc.shape[0]
    at = torch.from_numpy(acc)
    xts = [torch.from_numpy(x) for x in xs]
    for s in range(0, n, block):
        e = min(s + block, n)
        a = at[s:e]
        for x, w in zip(xts, ws):
            a.add_(x[s:e], alpha=w)


@functools.lru_cache(maxsize=None)
def blas_axpy(dtype: np.dtype):
    """scipy's BLAS axpy for float32/float64 (None for other dtypes); the first call imports scipy.linalg (about
    1 s), which an accumulator pays when it is made, not in its first fold."""
    from scipy.linalg import blas

    return {"float32": blas.saxpy, "float64": blas.daxpy}.get(np.dtype(dtype).name)


def fold_block_blas(acc: np.ndarray, xs: Sequence[np.ndarray], ws: Sequence[float],
                    tmp: np.ndarray, block: int) -> None:
    """Same sum with BLAS ``axpy``: one fused pass per update over the whole range, multithreaded by OpenBLAS
    (measured here at about 0.85x the machine's 2-thread read bandwidth, against 0.2x for two numpy passes).
    Updates whose dtype differs from the accumulator's take the numpy kernel."""
    axpy = blas_axpy(acc.dtype)
    for x, w in zip(xs, ws):
        if axpy is None or x.dtype != acc.dtype or not x.flags.c_contiguous or not acc.flags.c_contiguous:
            fold_block_numpy(acc, [x], [w], tmp, block)
            continue
        out = axpy(x, acc, a=w)
        if not np.shares_memory(out, acc):  # f2py copied instead of updating in place: write it back
            acc[...] = out


KERNELS = {"numpy": fold_block_numpy, "torch": fold_block_torch, "blas": fold_block_blas}
