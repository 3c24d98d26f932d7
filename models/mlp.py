"""A multilayer perceptron that flattens its input (e.g. 8x8 digits) before the dense layers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class MLP(nn.Module):
    """Flatten, then Linear+ReLU for each hidden width, then a Linear layer producing the logits."""

    def __init__(self, in_features: int = 64, hidden: Sequence[int] | int = (128,), num_classes: int = 10) -> None:
        super().__init__()
        hidden = (hidden,) if isinstance(hidden, int) else hidden  # hidden=8: one hidden layer of 8
        widths = [int(in_features), *(int(h) for h in hidden)]
        if any(w <= 0 for w in widths) or num_classes <= 0:
            raise ValueError(f"MLP sizes must be positive: in_features={in_features}, hidden={tuple(hidden)}, "
                             f"num_classes={num_classes}")
        self.in_features = widths[0]
        self.num_classes = int(num_classes)
        layers: list[nn.Module] = []
        for fan_in, fan_out in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], self.num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, num_classes) for inputs of shape (batch, ...) with in_features values each."""
        x = torch.flatten(x, start_dim=1)
        if x.shape[1] != self.in_features:
            raise ValueError(f"MLP expects {self.in_features} input features per example but got {x.shape[1]}; "
                             "build it with in_features matching the data")
        return self.net(x)
