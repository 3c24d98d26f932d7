"""Pipeline parallelism: split a block model into stages by deleting modules; torch.distributed.pipelining runs them."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import _PipelineSchedule

from fedpar.parallel.config import ConfigurationError
from fedpar.parallel.modules import block_container, block_names

FIRST_STAGE_ONLY = ("tok_embeddings",)
LAST_STAGE_ONLY = ("norm", "output")


def stage_ids_for_rank(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """Loop layout: rank r holds stages r, r+pp, r+2pp, ... (what the interleaved schedules expect)."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def split_blocks(names: list[str], num_stages: int) -> list[list[str]]:
    """Cut the ordered block names into ``num_stages`` contiguous groups whose sizes differ by at most one."""
    if num_stages > len(names):
        raise ConfigurationError(
            f"the model has {len(names)} blocks but {num_stages} pipeline stages were asked for (pp x stages per "
            f"rank); lower --pp/--stages-per-rank to at most {len(names)} stages or build a deeper model")
    base, extra = divmod(len(names), num_stages)
    groups, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        groups.append(names[start:start + size])
        start += size
    return groups


def check_pipeline_split(model: nn.Module, pp: int, stages_per_rank: int) -> None:
    """Raise ConfigurationError unless ``model`` can be cut into ``pp`` x ``stages_per_rank`` pipeline stages."""
    layers = block_container(model)
    if layers is None or not isinstance(layers, nn.ModuleDict):
        raise ConfigurationError("pipeline parallelism needs a model whose blocks sit in an nn.ModuleDict "
                                 "named 'layers' (the gpt model); use --pp 1 for this model")
    blocks, stages = len(layers), pp * stages_per_rank
    if stages > blocks:
        raise ConfigurationError(
            f"the model has {blocks} transformer blocks but --pp {pp} x --stages-per-rank {stages_per_rank} = "
            f"{stages} pipeline stages were asked for, and every stage needs at least one block; lower --pp or "
            f"--stages-per-rank to at most {blocks} stages in all, or build a deeper model "
            f"(--model-arg n_layer={stages})")


def build_stage_module(model: nn.Module, stage_index: int, num_stages: int) -> nn.Module:
    """A deep copy of ``model`` holding only this stage's blocks (plus the embeddings first / the head last).

    Removed parts become None, so parameter names stay those of the whole model (DCP checkpoints match).
    """
    layers = block_container(model)
    if layers is None or not isinstance(layers, nn.ModuleDict):
        raise ConfigurationError("pipeline parallelism needs a model whose blocks sit in an nn.ModuleDict "
                                 "named 'layers' (the gpt model); use --pp 1 for this model")
    keep = set(split_blocks(block_names(model), num_stages)[stage_index])
    stage = copy.deepcopy(model)
    for name in list(stage.layers.keys()):
        if name not in keep:
            del stage.layers[name]
    if stage_index > 0:
        for name in FIRST_STAGE_ONLY:
            if getattr(stage, name, None) is not None:
                setattr(stage, name, None)
    if stage_index < num_stages - 1:
        for name in LAST_STAGE_ONLY:
            if getattr(stage, name, None) is not None:
                setattr(stage, name, None)
    return stage


@dataclass
class Pipeline:
    """This rank's stage modules and the schedule that drives them."""

    modules: list[nn.Module]
    stages: list[PipelineStage]
    schedule: _PipelineSchedule
    eval_schedule: _PipelineSchedule

    @property
    def has_first_stage(self) -> bool:
        """True when this rank feeds the inputs."""
        return any(s.is_first for s in self.stages)

    @property
    def has_last_stage(self) -> bool:
        """True when this rank computes the loss."""
        return any(s.is_last for s in self.stages)

    def _inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Only the first stage's rank may pass inputs: torch 2.11 takes any positional argument (even None)
        # on a later stage as a shape-inference input and asserts; 2.13 ignores it. Contiguous, because 2.11
        # checks each microbatch's strides against a meta copy of the first one, and .to("meta") drops a view's
        # strides (a token batch sliced x = seq[:, :-1] would fail the check).
        return (x.contiguous(),) if self.has_first_stage else ()

    def step(self, x: torch.Tensor, y: torch.Tensor, losses: list | None = None, return_outputs: bool = True):
        """One training step of the schedule; inputs/targets are used only on the first/last stage's rank."""
        return self.schedule.step(*self._inputs(x), target=y if self.has_last_stage else None, losses=losses,
                                  return_outputs=return_outputs)

    def eval(self, x: torch.Tensor, y: torch.Tensor):
        """A forward-only pass; the last stage's rank gets the merged outputs back, the others None."""
        return self.eval_schedule.eval(*self._inputs(x), target=y if self.has_last_stage else None)


def build_schedule(stages: list[PipelineStage], name: str, microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> _PipelineSchedule:
    """GPipe / 1F1B over one stage per rank, or interleaved 1F1B over several."""
    if name == "interleaved1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    if len(stages) != 1:
        raise ConfigurationError(f"the {name} schedule runs one stage per rank; use interleaved1f1b for more")
    cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)


def build_pipeline(stage_modules: list[nn.Module], stage_ids: list[int], num_stages: int, device: torch.device,
                   pp_group: ProcessGroup, schedule: str, microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Pipeline:
    """Wrap already-parallelized stage modules in PipelineStages and build the schedule.

    ``loss_fn`` returns the mean loss of one microbatch; the schedule scales gradients by 1/microbatches.
    """
    def schedule_over_new_stages() -> tuple[list[PipelineStage], _PipelineSchedule]:
        stages = [PipelineStage(m, sid, num_stages, device, group=pp_group)
                  for m, sid in zip(stage_modules, stage_ids)]
        return stages, build_schedule(stages, schedule, microbatches, loss_fn)

    stages, train_schedule = schedule_over_new_stages()
    # Evaluation gets its own stages over the same modules: torch 2.11 fixes the receive buffers' requires_grad
    # when a schedule first runs, so a schedule whose first use was eval() cannot train afterwards.
    _, eval_schedule = schedule_over_new_stages()
    return Pipeline(stage_modules, stages, train_schedule, eval_schedule)
