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


def parameter_count(module: nn.Module) -> int:
    """How many parameter elements ``module`` holds (its children's included)."""
    return sum(p.numel() for p in module.parameters())


def shard_units(model: nn.Module, min_params: int) -> list[nn.Module]:
    """The modules FSDP shards one by one before the root: the transformer blocks, or for a model without them
    its children holding at least ``min_params`` parameters (looking inside a lone child that holds them all,
    such as an ``nn.Sequential`` body); smaller ones are gathered with the root."""
    blocks = transformer_blocks(model)
    if blocks:
        return blocks
    holders = [child for child in model.children() if parameter_count(child)]
    if len(holders) == 1 and not any(True for _ in model.parameters(recurse=False)):
        return shard_units(holders[0], min_params)
    return [child for child in holders if parameter_count(child) >= min_params]
