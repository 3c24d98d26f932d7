"""The MNIST CNN of the FedAvg paper (McMahan et al. 2017), sized for any square input."""

from __future__ import annotations

import torch
from torch import nn


class FedAvgCNN(nn.Module):
    """Two 5x5 'same' conv layers (32, 64 channels), each followed by 2x2 max pooling, a 512-unit ReLU layer, logits.

    With ``in_channels=1, image_size=28, num_classes=10`` it has 1,663,370 parameters, as in the paper.
    """

    def __init__(self, in_channels: int = 1, image_size: int = 28, num_classes: int = 10) -> None:
        super().__init__()
        if image_size < 4:
            raise ValueError(f"FedAvgCNN needs images of at least 4x4 pixels (two 2x2 poolings), got {image_size}")
        self.in_channels = int(in_channels)
        self.image_size = int(image_size)
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5, padding=2)
        self.pool = nn.MaxPool2d(2)
        pooled = image_size // 2 // 2
        self.fc1 = nn.Linear(64 * pooled * pooled, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (batch, num_classes) for images (batch, in_channels, image_size, image_size)."""
        if x.dim() != 4 or x.shape[1] != self.in_channels or x.shape[2:] != (self.image_size, self.image_size):
            raise ValueError(f"FedAvgCNN expects input (batch, {self.in_channels}, {self.image_size}, "
                             f"{self.image_size}) but got {tuple(x.shape)}")
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.relu(self.fc1(torch.flatten(x, start_dim=1)))
        return self.fc2(x)
