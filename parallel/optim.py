"""Optimizers per model part, learning-rate warmup, and gradient clipping over sharded and pipelined parameters."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fedpar.parallel.config import TrainConfig


def build_optimizers(parts: list[nn.Module], config: TrainConfig) -> list[torch.optim.Optimizer]:
    """One optimizer per model part (pipeline stages keep separate optimizers, as DCP expects)."""
    lr = config.scaled_lr()
    out: list[torch.optim.Optimizer] = []
    for part in parts:
        if config.optimizer == "adamw":
            out.append(torch.optim.AdamW(part.parameters(), lr=lr, weight_decay=config.weight_decay))
        else:
            out.append(torch.optim.SGD(part.parameters(), lr=lr, momentum=config.momentum,
                                       weight_decay=config.weight_decay))
    return out


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warmup from 1/warmup to 1 over the first ``warmup_steps`` steps, then 1."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


def set_learning_rate(optimizers: list[torch.optim.Optimizer], lr: float) -> None:
    """Set ``lr`` on every parameter group (computed from the step, so a resumed run needs no scheduler state)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr


def total_grad_norm(parameters: list[nn.Parameter], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The global L2 norm of all gradients, across shards (DTensor) and pipeline stages (``pp_group``)."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in parameters:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        groups[key].append(g)
    squares = torch.zeros((), dtype=torch.float32)
    for key, grads in groups.items():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares = squares + norm.float().cpu() ** 2
    if pp_group is not None:
        squares = squares.to(parameters[0].device if parameters else "cpu")
        dist.all_reduce(squares, group=pp_group)
    return squares.sqrt()


def clip_gradients(parameters: list[nn.Parameter], max_norm: float,
                   pp_group: dist.ProcessGroup | None = None) -> float:
    """Scale gradients so their global norm is at most ``max_norm``; returns the norm before clipping."""
    norm = total_grad_norm(parameters, pp_group)
    torch.nn.utils.clip_grads_with_norm_([p for p in parameters if p.grad is not None], max_norm, norm.to(
        parameters[0].device) if parameters else norm)
    return float(norm)
