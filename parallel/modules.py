"""Finding the parts of a model that the parallelisms act on (blocks, embeddings, head)."""

from __future__ import annotations

from torch import nn


def block_container(model: nn.Module) -> nn.ModuleDict | nn.ModuleList | None:
    """The ``layers`` container of transformer blocks, or None for models without one."""
    layers = getattr(model, "layers", None)
    return layers if isinstance(layers, (nn.ModuleDict, nn.ModuleList)) else None


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks in order (empty for models without a ``layers`` container)."""
    layers = block_container(model)
    if layers is None:
        return []
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def block_names(model: nn.Module) -> list[str]:
    """The keys of the blocks in ``model.layers`` as strings, in order."""
    layers = block_container(model)
    if layers is None:
        return []
    return list(layers.keys()) if isinstance(layers, nn.ModuleDict) else [str(i) for i in range(len(layers))]
