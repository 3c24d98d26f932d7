"""What an evaluation measured: loss, accuracy and named metrics on some examples."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


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
