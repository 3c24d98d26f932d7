"""Pick a zoo model's constructor arguments from a dataset's input shape and class count."""

from __future__ import annotations

import math

from torch import nn

from fedpar.models.registry import build_model


def build_model_for_data(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A classifier called ``name`` ("mlp" or "cnn") sized for inputs of ``input_shape`` (C, H, W)."""
    if name == "mlp":
        return build_model("mlp", in_features=math.prod(input_shape), num_classes=num_classes)
    if name == "cnn":
        if len(input_shape) != 3 or input_shape[1] != input_shape[2]:
            raise ValueError(f"the cnn needs square images shaped (C, H, W), got {input_shape}")
        return build_model("cnn", in_channels=input_shape[0], image_size=input_shape[1], num_classes=num_classes)
    raise ValueError(f"model {name!r} is not an image classifier for this data; use mlp or cnn "
                     "(gpt trains on text corpora)")
