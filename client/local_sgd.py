"""Local SGD's arithmetic and counts, which the one local loop (client/local_loop.py) steps with: the plain SGD update
and the tally of steps, examples and losses."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.optim.sgd import sgd



@dataclass
class TrainResult:
    """What one local training run did: the honest basis of the update's FedAvg weight."""

    steps: int
    examples: int  # examples actually trained on (counted once per epoch they were seen in)
    loss: float
    stopped_early: bool
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)  # other named metrics (a task's own training)

    def as_metrics(self) -> dict[str, float]:
        """What an agent reports of it: train_seconds, train_loss and train_NAME, where finite."""
        named = {"loss": self.loss, **self.metrics, "seconds": self.seconds}
        return {f"train_{k}": float(v) for k, v in named.items() if math.isfinite(v)}


@dataclass
class StepTally:
    """Steps taken so far, the examples they trained on, the sum of their losses, and whether a deadline stopped
    them (``loss_sum`` may be a tensor, so that counting does not wait for the device)."""

    steps: int = 0
    examples: int = 0
    loss_sum: float | torch.Tensor = 0.0
    stopped: bool = False

    def result(self, seconds: float) -> TrainResult:
        """The TrainResult of these steps: the mean loss per example (NaN when none was trained on)."""
        loss = float(self.loss_sum) / self.examples if self.examples else math.nan
        return TrainResult(self.steps, self.examples, loss, self.stopped, seconds)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters SGD updates."""
    return [p for p in model.parameters() if p.requires_grad]


@torch.no_grad()
def sgd_step(params: list[nn.Parameter], lr: float) -> None:
    """Plain SGD on the parameters that have a gradient, with torch.optim.SGD's own update function.

    The functional form skips the Optimizer object, whose first construction in a process imports
    torch._dynamo (about 1.2 s of CPU here, paid again by every simulation worker process); the arithmetic
    is the one ``torch.optim.SGD(params, lr).step()`` runs.
    """
    with_grad = [p for p in params if p.grad is not None]
    if with_grad:
        sgd(with_grad, [p.grad for p in with_grad], [None] * len(with_grad), weight_decay=0.0, momentum=0.0, lr=lr,
            dampening=0.0, nesterov=False, maximize=False)
