"""Scoring a classifier: loss and accuracy on some examples, and the coordinator's central evaluation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedpar.models.losses import classification_loss
from fedpar.models.weights import set_weights


@dataclass
class EvalResult:
    """Loss and accuracy of a model on some examples."""

    loss: float
    accuracy: float | None  # None: not measured (a Flower client's evaluate without an "accuracy" metric)
    examples: int


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


class CentralEvaluator:
    """The coordinator's evaluation of each new global model on a held-out test set, on ``device``."""

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device | str = "cpu"):
        """Keep ``model`` and the test set on ``device`` for every later call."""
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.x, self.y = x.to(self.device), y.to(self.device)

    def __call__(self, weights: Sequence[np.ndarray]) -> dict[str, float]:
        """``test_loss`` and ``test_accuracy`` of the model with ``weights``."""
        set_weights(self.model, weights)
        result = evaluate_classifier(self.model, self.x, self.y)
        return {"test_loss": result.loss, "test_accuracy": result.accuracy}
