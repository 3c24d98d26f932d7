"""Aggregation across processes: all-reduce of partial weighted sums (as DDP does for gradients).

The building block of aggregator ranks (several coordinator processes, each folding its share of a round's
uploads); the coordinator itself still aggregates in one process today. Tested on gloo, and on NCCL where GPUs are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fedpar.aggregation.accumulator import WeightedSum


def all_reduce_weighted_sum(acc: WeightedSum, group: dist.ProcessGroup | None = None) -> None:
    """Sum every rank's partial ``acc`` (buffers, total weight, count) in place, so all ranks hold the total.

    Each aggregator rank folds its own share of the clients into ``acc``, then calls this once at the
    end of the round; afterwards ``acc.mean()`` is the round's global FedAvg on every rank. On NCCL
    groups the buffers travel through the current CUDA device; on gloo they are reduced in place.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call init_process_group before all-reducing")
    use_cuda = dist.get_backend(group) == "nccl"
    for buf in acc.buffers.values():
        if isinstance(buf, torch.Tensor):  # a DeviceWeightedSum (aggregation/accumulator.py): reduced there
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
            continue
        t = torch.from_numpy(buf)
        if use_cuda:
            dev = t.cuda()
            dist.all_reduce(dev, op=dist.ReduceOp.SUM, group=group)
            t.copy_(dev.cpu())
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    totals = torch.tensor([acc.total_weight, float(acc.count)], dtype=torch.float64)
    if use_cuda:
        totals = totals.cuda()
    dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
    total_weight, count = totals.cpu().tolist()
    acc.total_weight = float(total_weight)
    acc.count = int(round(count))

