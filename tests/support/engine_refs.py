"""References for the engine's multi-rank checks: a tiny model, the LM loss, dense clipped-step references."""

from __future__ import annotations

import math

import torch
from torch import nn

from fedpar.models.losses import language_model_loss as lm_loss  # noqa: F401 (the name the checks import)
from fedpar.parallel.optim import clip_gradients, total_grad_norm

CLIP_LR = 0.1


class TinyMLP(nn.Sequential):
    """in -> hidden -> hidden -> classes with ReLU (and optional dropout, to exercise RNG restore)."""

    def __init__(self, n_in: int = 16, hidden: int = 32, n_out: int = 4, dropout: float = 0.0) -> None:
        """Three Linear layers (the last stays replicated under TP)."""
        super().__init__(nn.Linear(n_in, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, n_out))


def local_numel(t: torch.Tensor) -> int:
    """Elements this rank actually stores for ``t`` (the local shard of a DTensor)."""
    return t.to_local().numel() if hasattr(t, "to_local") else t.numel()


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor (collective), or ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over the keys of ``a`` (missing keys count as infinite)."""
    worst = 0.0
    for k, v in a.items():
        if k not in b:
            return math.inf
        worst = max(worst, (v.detach().float() - b[k].detach().float()).abs().max().item())
    return worst


def dense_clipped_sgd_step(ref: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn) -> tuple[float, float]:
    """One SGD step of ``ref`` with its gradients clipped to half their norm; returns (norm, max_norm)."""
    loss_fn(ref(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf).item()  # max_norm inf: measure only
    max_norm = norm / 2
    torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    torch.optim.SGD(ref.parameters(), lr=CLIP_LR).step()
    return norm, max_norm


def clipped_sgd_step(params: list[nn.Parameter], max_norm: float, pp_group=None) -> dict[str, float]:
    """clip_gradients then one SGD step on this rank's (sharded or staged) parameters."""
    local_norm = total_grad_norm(params).item()  # without the pipeline all-reduce: this rank's stages only
    norm = clip_gradients(params, max_norm, pp_group)
    clipped_norm = total_grad_norm(params, pp_group).item()
    torch.optim.SGD(params, lr=CLIP_LR).step()
    return {"norm": norm, "local_norm": local_norm, "clipped_norm": clipped_norm}
