"""torch.compile applied the torchtitan way: each transformer block in place, after TP and checkpointing, before FSDP.

Blocks share their code, so Dynamo compiles one block graph and reuses it for every block (no recompiles);
compiling in place (``Module.compile``) keeps parameter names, so DCP checkpoints and the pipeline split see the
same model. ``fullgraph=True`` turns a graph break into an error instead of a silent slowdown.
"""

from __future__ import annotations

import torch
from torch import nn

from fedpar.parallel.config import ConfigurationError, ParallelConfig
from fedpar.parallel.modules import transformer_blocks


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_compile_layout(family: str, config: ParallelConfig) -> None:
    """Raise ConfigurationError for a layout that --compile is known to fail on."""
    # Seen with torch 2.13 (CPU, gloo): the backward of the eager TP output layer receives a plain tensor
    # from the compiled blocks ("'Tensor' object has no attribute '_local_tensor'"); torch 2.11 trains fine.
    if config.tp > 1 and family == "gpt" and _torch_version() >= (2, 12):
        raise ConfigurationError(
            f"--compile with --tp > 1 fails in torch {torch.__version__}'s DTensor backward for the gpt model "
            "(it works with torch 2.11); drop --compile, or use --fsdp/--dp-replicate instead of --tp")


def apply_compile(model: nn.Module) -> nn.Module:
    """Compile every transformer block of ``model`` in place, or the forward of a model without blocks.

    A block-less model has its ``forward`` compiled rather than the module call, so the hooks that FSDP and DDP
    put on the root module stay outside the graph (compiling the call would trace them and fail).
    """
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile(fullgraph=True)
    if not blocks:
        model.forward = torch.compile(model.forward, fullgraph=True)
    return model
