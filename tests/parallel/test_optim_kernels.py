"""Optimizer kernels: auto picks fused AdamW, each choice reaches torch, and fused SGD on shards is refused."""

from __future__ import annotations

import pytest
import torch

from fedpar.parallel.config import ConfigurationError, ParallelConfig, TrainConfig
from fedpar.parallel.optim import build_optimizers, optimizer_kwargs


def test_fused_sgd_on_sharded_parameters_is_refused():
    cfg = TrainConfig(optimizer="sgd", optimizer_impl="fused", parallel=ParallelConfig(dp=1, fsdp=2).resolved(2))
    with pytest.raises(ConfigurationError, match="no fused SGD"):
        cfg.check()
    TrainConfig(optimizer="sgd", optimizer_impl="fused", parallel=ParallelConfig().resolved(1)).check()


@pytest.mark.parametrize("optimizer, impl, device, expected", [
    ("adamw", "auto", "cpu", {"fused": True}),
    ("adamw", "auto", "cuda", {"fused": True}),
    ("sgd", "auto", "cpu", {}),
    ("sgd", "auto", "cuda", {}),
    ("adamw", "foreach", "cuda", {"foreach": True}),
    ("adamw", "for-loop", "cpu", {"foreach": False}),
    ("sgd", "fused", "cpu", {"fused": True}),
])
def test_optimizer_kernel_choice(optimizer, impl, device, expected):
    assert optimizer_kwargs(optimizer, impl, device) == expected


def test_build_optimizers_passes_the_choice_to_torch():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    (adamw,) = build_optimizers([model], TrainConfig(optimizer="adamw"), "cpu")
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["fused"] is True
    (loop,) = build_optimizers([model], TrainConfig(optimizer="adamw", optimizer_impl="for-loop"), "cpu")
    assert loop.defaults["foreach"] is False and not loop.defaults["fused"]
    (sgd,) = build_optimizers([model], TrainConfig(optimizer="sgd"), "cpu")
    assert sgd.defaults["foreach"] is None and not sgd.defaults["fused"]
    assert len(adamw.param_groups) == 1  # one layout (plain tensors): one group
    model(torch.randn(3, 4)).sum().backward()
    adamw.step()
