"""Compose the parallelisms over one model, torchtitan's order: PP split, TP/SP, activation checkpointing, compile,
FSDP/DDP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from fedpar.parallel.compile import apply_compile, check_compile_layout
from fedpar.parallel.config import ParallelConfig, ParallelLayout
from fedpar.parallel.ddp import apply_ddp
from fedpar.parallel.fsdp import apply_fsdp, mixed_precision_policy, offload_policy
from fedpar.parallel.init import DistInfo
from fedpar.parallel.mesh import ParallelMesh
from fedpar.parallel.modules import block_container, block_names
from fedpar.parallel.pp import (
    Pipeline,
    build_pipeline,
    build_stage_module,
    check_pipeline_split,
    stage_ids_for_rank,
)
from fedpar.parallel.tp import PlanFn, apply_tp, check_tp_divisible

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ParallelModel:
    """This rank's model parts (one, or its pipeline stages) and the pipeline that drives them, if any."""

    parts: list[nn.Module]
    pipeline: Pipeline | None
    family: str

    @property
    def has_last_stage(self) -> bool:
        """True when this rank produces the model's outputs (always, without pipelining)."""
        return self.pipeline is None or self.pipeline.has_last_stage

    @property
    def has_first_stage(self) -> bool:
        """True when this rank consumes the model's inputs (always, without pipelining)."""
        return self.pipeline is None or self.pipeline.has_first_stage

    def parameters(self) -> list[nn.Parameter]:
        """All parameters this rank holds (shards for FSDP/TP)."""
        return [p for part in self.parts for p in part.parameters()]


def check_model_layout(model: nn.Module, family: str, config: ParallelConfig, tp_plan: PlanFn | None = None) -> None:
    """Raise ConfigurationError when the whole (unsplit) ``model`` cannot take the pipeline or TP degrees
    (``tp_plan``: a task's own tensor-parallel plan, instead of the family's)."""
    if config.pp > 1:
        check_pipeline_split(model, config.pp, config.stages_per_rank)
    if config.tp > 1:
        check_tp_divisible(model, family, config.tp, tp_plan)


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each transformer block (or each top-level child of a block-less model) in backward."""
    layers = block_container(model)
    if layers is not None:
        for name in block_names(model):
            layers[name] = checkpoint_wrapper(layers[name])
        return model
    for name, child in list(model.named_children()):
        if any(True for _ in child.parameters()):
            setattr(model, name, checkpoint_wrapper(child))
    return model


def _data_parallel(part: nn.Module, config: ParallelLayout, mesh: ParallelMesh) -> nn.Module:
    device_type = mesh.mesh.device_type
    if config.fsdp > 1:
        dp_mesh = mesh[("dp", "fsdp")] if config.dp > 1 else mesh["fsdp"]
        return apply_fsdp(part, dp_mesh, mixed_precision_policy(config.precision),
                          offload_policy(config.cpu_offload, device_type), config.reshard_after_forward)
    if config.dp > 1:
        return apply_ddp(part, mesh["dp"])
    return part


def parallelize(model_fn: Callable[[], nn.Module], family: str, config: ParallelLayout, mesh: ParallelMesh,
                info: DistInfo, loss_fn: LossFn, seed: int, activation_checkpointing: bool = False,
                compile: bool = False, tp_plan: PlanFn | None = None) -> ParallelModel:
    """Build the whole model with ``seed`` on every rank (never meta-init on CPU), then split and shard it
    (``tp_plan``: a task's own tensor-parallel plan; else the family's).

    Identical seeds make every rank start from the same full weights, so each shard is the right slice.
    """
    torch.manual_seed(seed)
    model = model_fn().to(info.device)
    check_model_layout(model, family, config, tp_plan)
    if compile:
        check_compile_layout(family, config)
    if config.pp > 1:
        stage_ids = stage_ids_for_rank(mesh.coord("pp"), config.pp, config.stages_per_rank)
        parts = [build_stage_module(model, sid, config.num_stages) for sid in stage_ids]
        del model
    else:
        stage_ids, parts = [0], [model]
    for i, part in enumerate(parts):
        if config.tp > 1:
            part = apply_tp(part, mesh["tp"], family, config.sequence_parallel, tp_plan)
        if activation_checkpointing:
            part = apply_activation_checkpointing(part)
        if compile:
            part = apply_compile(part)
        parts[i] = _data_parallel(part, config, mesh)
    pipeline = None
    if config.pp > 1:
        pipeline = build_pipeline(parts, stage_ids, config.num_stages, info.device, mesh["pp"].get_group(),
                                  config.pp_schedule, config.microbatches, loss_fn)
    return ParallelModel(parts, pipeline, family)
