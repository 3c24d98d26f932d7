"""The training losses of the model zoo: cross-entropy for classifiers and for next-token language models."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def classification_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of class logits (computed in fp32): the batch mean, or as ``reduction`` says."""
    return F.cross_entropy(logits.float(), targets, reduction=reduction)


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy over batch and sequence (computed in fp32): the mean over every token, or as
    ``reduction`` says (``"none"``: one loss per token, flattened)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction=reduction)
