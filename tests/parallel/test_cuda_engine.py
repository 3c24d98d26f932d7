"""The engine's GPU paths: flash attention in bf16, fused AdamW, compiled bf16 training and its peak memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fedpar.models.gpt import GPT, GPTConfig
from fedpar.parallel.config import TrainConfig
from fedpar.parallel.optim import build_optimizers

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.timeout(600)]


def _gpt(dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    # head_dim 64, the GPT-2 size; flash takes head dims up to 256.
    return GPT(GPTConfig(vocab_size=65, block_size=128, n_layer=2, n_head=4, d_model=256, dropout=dropout)).cuda()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gpt_attention_runs_on_the_flash_kernel_in_bf16(dropout):
    """sdpa_kernel(FLASH_ATTENTION) raises if SDPA cannot take flash: under autocast and with bf16 weights."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x = torch.randint(0, 65, (4, 128), device="cuda")
    model = _gpt(dropout).train()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        with torch.autocast("cuda", dtype=torch.bfloat16):  # the one-GPU trainer's bf16
            logits = model(x)
        F.cross_entropy(logits.flatten(0, 1).float(), x.flatten()).backward()
        assert logits.dtype == torch.bfloat16
        model.to(torch.bfloat16)  # what FSDP's MixedPrecisionPolicy hands the blocks
        F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_adamw_is_fused_on_cuda_and_steps_like_the_for_loop():
    """The same gradients into fused and for-loop AdamW (attention backward may add in any order, so share them)."""
    fused_model, loop_model = _gpt(), _gpt()
    (fused,) = build_optimizers([fused_model], TrainConfig(optimizer="adamw", lr=1e-3), "cuda")
    (loop,) = build_optimizers([loop_model], TrainConfig(optimizer="adamw", lr=1e-3, optimizer_impl="for-loop"),
                               "cuda")
    assert fused.defaults["fused"] is True and loop.defaults["foreach"] is False
    x = torch.randint(0, 65, (4, 128), device="cuda")
    for _ in range(3):
        F.cross_entropy(fused_model(x).flatten(0, 1), x.flatten()).backward()
        for a, b in zip(fused_model.parameters(), loop_model.parameters()):
            b.grad = a.grad.clone()
        for opt in (fused, loop):
            opt.step()
            opt.zero_grad(set_to_none=True)
    worst = max((a - b).abs().max().item() for a, b in zip(fused_model.parameters(), loop_model.parameters()))
    assert worst < 1e-6


def _train(tmp_path: Path, name: str, *flags: str) -> tuple[dict, dict[int, float]]:
    from fedpar.cli.main import main

    text = tmp_path / "tiny.txt"
    if not text.exists():
        text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / name
    assert main(["train", "--model", "gpt", "--dataset", "text", "--data-path", str(text), "--block-size", "64",
                 "--batch-size", "16", "--max-steps", "20", "--optimizer", "adamw", "--lr", "3e-3",
                 "--log-every", "5", "--eval-batches", "1", "--no-plot", "--out", str(out), *flags]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return summary, {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def test_one_gpu_training_with_compile_in_bf16(tmp_path: Path, monkeypatch):
    """--compile on one GPU: bf16 autocast, the loss falls like the eager run's, and the peak counts from the start."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _, eager = _train(tmp_path, "eager")
    ballast = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")  # 2 GiB, freed before training starts
    del ballast
    summary, compiled = _train(tmp_path, "compiled", "--compile")
    assert (summary["backend"], summary["precision"], summary["config"]["compile"]) == ("nccl", "bf16", True)
    assert summary["peak_memory_source"] == "torch.cuda.max_memory_allocated"
    assert 0 < summary["peak_memory_bytes"][0] < 2 * 2**30  # reset when training starts: the ballast is not in it
    assert compiled[20] < compiled[5]
    assert compiled == pytest.approx(eager, rel=0.1)  # bf16: compiled and eager round differently
