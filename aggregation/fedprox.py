"""FedProx (Li et al. 2020): FedAvg at the server, a proximal term ``mu/2 ||w - w_global||^2`` at the client."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from fedpar.aggregation.accumulator import FoldConfig
from fedpar.aggregation.catalog import register_strategy
from fedpar.aggregation.strategy import StreamingStrategy
from fedpar.protocol.task_settings import TaskSettings

if TYPE_CHECKING:  # the client-side terms import torch when they run: the strategy catalog must not pay it
    import torch


def proximal_term(model_params: Iterable[torch.Tensor], global_params: Iterable[torch.Tensor],
                  mu: float) -> torch.Tensor:
    """``mu/2 * sum ||w - w_global||^2``; add it to the client's loss (``global_params`` are treated as constants)."""
    model_params = list(model_params)
    global_params = list(global_params)
    if len(model_params) != len(global_params):
        raise ValueError(f"proximal_term got {len(model_params)} model tensors but {len(global_params)} global ones")
    if not model_params:
        raise ValueError("proximal_term needs at least one parameter tensor")
    import torch

    total = model_params[0].new_zeros(())
    for w, g in zip(model_params, global_params):
        total = total + torch.sum((w - g.detach().to(w.dtype)) ** 2)
    return 0.5 * mu * total


def add_proximal_gradient(model_params: Iterable[torch.Tensor], global_params: Iterable[torch.Tensor],
                          mu: float) -> None:
    """Add the gradient of :func:`proximal_term`, ``mu * (w - w_global)``, to each parameter's ``.grad``.

    For sharded parameters, whose loss cannot hold the term without a collective: each shard adds its own part.
    Parameters without a gradient are left alone.
    """
    import torch

    with torch.no_grad():
        for w, g in zip(model_params, global_params, strict=True):
            if w.grad is not None:
                w.grad.add_(w.detach() - g, alpha=mu)


@register_strategy
class FedProx(StreamingStrategy):
    """FedAvg aggregation; ``proximal_mu`` is sent to clients, whose trainer adds :func:`proximal_term` (or, on
    sharded parameters, its gradient)."""

    name = "fedprox"

    def __init__(self, proximal_mu: float = 0.01, fold_config: FoldConfig | None = None) -> None:
        """Set the proximal coefficient mu (>= 0)."""
        super().__init__(fold_config)
        if proximal_mu < 0:
            raise ValueError(f"mu (proximal_mu) must be >= 0, got {proximal_mu}")
        self.proximal_mu = float(proximal_mu)

    def client_config(self, round_id: int) -> TaskSettings:
        """Every client gets ``proximal_mu``."""
        return TaskSettings(proximal_mu=self.proximal_mu)
