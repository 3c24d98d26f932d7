"""Scoring a classifier: loss and accuracy on some examples."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from fedpar.models.losses import classification_loss


@dataclass
class EvalResult:
    """Loss and accuracy of a model on some examples (None: not measured), and any other named metrics."""

    loss: float | None
    accuracy: float | None  # None: not measured (a Flower client's evaluate without an "accuracy" metric)
    examples: int
    metrics: dict[str, float] = field(default_factory=dict)

    def as_metrics(self) -> dict[str, float]:
        """What an agent reports of it: eval_loss, eval_accuracy, eval_examples and eval_NAME, where finite."""
        named = {"loss": self.loss, "accuracy": self.accuracy, **self.metrics, "examples": float(self.examples)}
        return {f"eval_{k}": float(v) for k, v in named.items() if v is not None and math.isfinite(v)}


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
