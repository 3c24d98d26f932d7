"""Data parallelism by replication: PyTorch's DistributedDataParallel over one mesh dimension."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, bucket_cap_mb: float = 25.0) -> DistributedDataParallel:
    """Wrap ``model`` in DDP over ``dp_mesh``; gradients are averaged across its ranks in backward.

    On CPU no ``device_ids`` may be passed (DDP rejects them for CPU modules).
    """
    device = next(model.parameters()).device
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), device_ids=device_ids,
                                   bucket_cap_mb=bucket_cap_mb)


def is_ddp(model: nn.Module) -> bool:
    """True when ``model`` is DDP-wrapped."""
    return isinstance(model, DistributedDataParallel)


__all__ = ["apply_ddp", "is_ddp"]
