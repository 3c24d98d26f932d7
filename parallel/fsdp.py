"""Fully sharded data parallelism with FSDP2 ``fully_shard`` (HSDP when given a 2-D mesh)."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from fedpar.models.gpt import GPT
from fedpar.parallel.modules import shard_units

MIN_UNIT_PARAMS = 1 << 20  # a block-less model's children smaller than this are gathered with the root


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """bf16 parameters with fp32 gradient reduction for "bf16", plain fp32 otherwise (see precision.py)."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def offload_policy(enabled: bool, device_type: str) -> OffloadPolicy:
    """CPU offload of sharded parameters; memory pinning only exists with an accelerator."""
    if not enabled:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None,
               offload: OffloadPolicy | None = None, reshard_after_forward: bool = True,
               min_unit_params: int = MIN_UNIT_PARAMS) -> nn.Module:
    """Shard every transformer block (any model: every child big enough, see ``shard_units``), then the root,
    over ``mesh`` (1-D: FSDP; 2-D replicate x shard: HSDP).

    Blocks are sharded separately so only one block's parameters are all-gathered at a time.
    """
    # asked before sharding: FSDP makes every parameter a DTensor and the model's class FSDP<its class>
    tensor_parallel_gpt = type(model) is GPT and any(isinstance(p, DTensor) for p in model.parameters())
    kwargs = dict(mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy(), offload_policy=offload or OffloadPolicy())
    blocks = shard_units(model, min_unit_params)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward, so keep them gathered.
        fully_shard(block, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    if tensor_parallel_gpt:
        # its tensor-parallel output layer returns DTensor.to_local(), a view (for autograd), and FSDP warns on every
        # rank that an in-place op on it would skip a hook: the zoo GPT's losses make none
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPGPT\) returned a view tensor",
                                category=UserWarning)
    return model


def is_fsdp(model: nn.Module) -> bool:
    """True when ``fully_shard`` was applied to ``model``."""
    return isinstance(model, FSDPModule)
