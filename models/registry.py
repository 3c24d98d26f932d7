"""Build the zoo's models by name: "mlp", "cnn", "gpt"."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

from torch import nn

from fedpar.models.cnn import FedAvgCNN
from fedpar.models.gpt import GPT, GPTConfig
from fedpar.models.mlp import MLP


def _build_gpt(config: GPTConfig | None = None, **kwargs: object) -> GPT:
    if config is not None and kwargs:
        raise ValueError("pass either config=GPTConfig(...) or GPTConfig fields as keywords to gpt, not both")
    return GPT(config if config is not None else GPTConfig(**kwargs))


_BUILDERS: dict[str, Callable[..., nn.Module]] = {"mlp": MLP, "cnn": FedAvgCNN, "gpt": _build_gpt}


def model_names() -> list[str]:
    """The names ``build_model`` accepts."""
    return sorted(_BUILDERS)


def _accepted_keywords(name: str) -> list[str]:
    if name == "gpt":
        return ["config", *(f.name for f in dataclasses.fields(GPTConfig))]
    return [p for p in inspect.signature(_BUILDERS[name]).parameters if p != "self"]


def build_model(name: str, **kwargs: object) -> nn.Module:
    """Construct the model called ``name`` with constructor keywords (GPTConfig fields, or config=, for gpt)."""
    key = name.lower()
    if key not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid names are: {', '.join(model_names())}")
    unknown = sorted(set(kwargs) - set(_accepted_keywords(key)))
    if unknown:
        raise ValueError(f"model {key!r} does not take {', '.join(unknown)}; "
                         f"it accepts: {', '.join(_accepted_keywords(key))}")
    try:
        return _BUILDERS[key](**kwargs)
    except (TypeError, ValueError) as exc:  # a keyword of the wrong kind or size (a word for a number, 0 widths)
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ValueError(f"model {key!r} cannot be built with {given}: {exc}") from None

