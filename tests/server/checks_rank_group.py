"""Checks of the aggregator ranks' group on 2 gloo ranks, run by tests/server/test_rank_group.py in one spawned
process group (support/spawn_checks.py)."""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

from fedpar.server.ranks import group as rank_group


def check_broadcast_arrays_in_buckets() -> dict:
    """A model's tensors of mixed dtypes and shapes (a 0-d one too) reach rank 1 bit for bit when small ones share a
    bucket and a large one goes alone, in the buckets both ranks cut alike; rank 0's strided array is read as is."""
    rank_group.BROADCAST_BUCKET_BYTES = 64  # so this small model needs several buckets and one tensor goes alone
    group = rank_group.RankGroup(30.0, "fedpar/ranks/check")
    rng = np.random.default_rng(7)
    model = [rng.standard_normal((3, 5)).astype(np.float32), rng.standard_normal(7).astype(np.float16),
             np.arange(4, dtype=np.int64).reshape(2, 2), np.array(2.5), rng.standard_normal(40).astype(np.float32),
             rng.standard_normal((2, 3)).astype(np.float64)]
    if dist.get_rank() == 0:
        arrays = [*model[:5], np.asfortranarray(model[5])]  # rank 0 may hold a strided array: it is read as is
    else:
        arrays = [np.zeros_like(a) for a in model]
    group.broadcast_arrays(arrays)
    same = all(a.dtype == m.dtype and a.shape == m.shape and a.tobytes() == m.tobytes()
               for a, m in zip(arrays, model))
    refused = ""
    if dist.get_rank() == 1:
        try:
            group.broadcast_arrays([np.zeros((4, 4), np.float32)[:, ::2]])  # a strided receiver: refused, not lost
        except ValueError as exc:
            refused = str(exc)
    return {"same": float(same), "refused": float(refused == "broadcast_arrays fills C-contiguous arrays in place")
            if dist.get_rank() == 1 else 1.0}
