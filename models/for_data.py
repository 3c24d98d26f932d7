"""Pick a zoo model's constructor arguments from what a dataset tells it: a classification set's input shape and
class count, or a text corpus's vocabulary and context length."""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from fedpar.models.registry import build_model


def classifier_kwargs(name: str, input_shape: tuple[int, ...], num_classes: int) -> dict[str, Any]:
    """Constructor keywords of classifier ``name`` ("mlp" or "cnn") sized for inputs of ``input_shape`` (C, H, W)."""
    if name == "mlp":
        return {"in_features": math.prod(input_shape), "num_classes": num_classes}
    if name == "cnn":
        if len(input_shape) != 3 or input_shape[1] != input_shape[2]:
            raise ValueError(f"the cnn needs square images shaped (C, H, W), got {input_shape}")
        return {"in_channels": input_shape[0], "image_size": input_shape[1], "num_classes": num_classes}
    raise ValueError(f"model {name!r} is not an image classifier for this data; use mlp or cnn "
                     "(gpt trains on text corpora)")


def build_model_for_data(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A classifier called ``name`` ("mlp" or "cnn") sized for inputs of ``input_shape`` (C, H, W)."""
    return build_model(name, **classifier_kwargs(name, input_shape, num_classes))


def model_kwargs_for(model: str, implied: dict[str, Any], user: dict[str, Any]) -> dict[str, Any]:
    """Keywords for ``build_model``: what the data implies for ``model`` (``implied``: ``input_shape`` and
    ``num_classes`` of a classification set, or ``vocab_size`` and ``block_size`` of a text corpus), overridden by
    the user's."""
    text = "vocab_size" in implied
    if model == "gpt" and not text:
        raise ValueError("the gpt model trains on --dataset text; the mlp and cnn models on digits or mnist")
    if model != "gpt" and text:
        raise ValueError(f"--dataset text is a language-modelling corpus; use --model gpt, not {model}")
    base = dict(implied) if text else classifier_kwargs(model, implied["input_shape"], implied["num_classes"])
    for key in DATA_SIZED.intersection(user).intersection(base):  # a model smaller than its data fails mid-training
        given = user[key]
        fits = isinstance(given, int) and (given >= base[key] if key in AT_LEAST else given == base[key])
        if not fits:
            must = "at least" if key in AT_LEAST else "exactly"
            also = f" (or lower --block-size to {given})" if key == "block_size" and isinstance(given, int) else ""
            raise ValueError(f"--model-arg {key}={user[key]!r}: the data needs {must} {base[key]}; leave it out and "
                             f"the data sets it{also}")
    return {**base, **user}


# What the data sizes: a user's value must match it (the inputs), or be at least it (the classes, the vocabulary,
# the context length: a gpt's block_size below --block-size raised on the first forward, in every rank).
AT_LEAST = frozenset({"num_classes", "vocab_size", "block_size"})
DATA_SIZED = AT_LEAST | {"in_features", "in_channels", "image_size"}
