"""A classifier's mean cross-entropy and accuracy on a test set, in one plain loop: what tests and benchmarks check
the coordinator's test_loss and test_accuracy against."""

from __future__ import annotations

import torch
from torch import nn

from fedpar.models.losses import classification_loss
from fedpar.tasks.evaluation import EvalResult


@torch.no_grad()
def evaluate_classifier(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> EvalResult:
    """Mean cross-entropy and accuracy of ``model`` on ``(x, y)`` (on the device the model and data are on)."""
    model.eval()
    loss = torch.zeros((), dtype=torch.float64, device=y.device)
    correct = torch.zeros((), dtype=torch.int64, device=y.device)
    for begin in range(0, len(y), batch_size):
        logits = model(x[begin:begin + batch_size]).float()
        target = y[begin:begin + batch_size]
        loss += classification_loss(logits, target, reduction="sum")
        correct += (logits.argmax(dim=1) == target).sum()
    return EvalResult(loss.item() / len(y), correct.item() / len(y), len(y))  # one device sync, at the end
