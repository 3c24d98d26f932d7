"""The size of a model, for the tests that pin each zoo model's architecture."""

from __future__ import annotations

from torch import nn


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters (trainable or not), counting shared parameters once."""
    return sum(p.numel() for p in model.parameters())
