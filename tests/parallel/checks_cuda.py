"""Rank bodies for tests/parallel/test_cuda.py: NCCL groups on GPUs (one GPU per rank; one rank on a one-GPU box).

Not a test module (no ``test_`` prefix): ``run_checks`` spawns the group with ``device="cuda"`` and calls these.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from fedpar.aggregation import FoldConfig, ShapesAndDtypes, WeightedSum, fedavg
from fedpar.parallel.config import ParallelConfig, TrainConfig
from fedpar.datasets.arrays import CLASSIFICATION, TrainData
from fedpar.parallel.fsdp import apply_fsdp, mixed_precision_policy
from fedpar.parallel.init import init_distributed
from fedpar.parallel.precision import uses_autocast
from fedpar.parallel.trainer import Trainer

from fedpar.aggregation.distributed import all_reduce_weighted_sum
from support.engine_refs import TinyMLP

SHAPES = [(300, 41), (41,), (7, 3, 5)]


def _cohort(k: int = 7, seed: int = 0) -> list[tuple[list[np.ndarray], int]]:
    rng = np.random.default_rng(seed)
    return [([rng.standard_normal(s).astype(np.float32) for s in SHAPES], int(rng.integers(1, 20))) for _ in range(k)]


def check_nccl_all_reduce_of_weighted_sums():
    """Each rank folds its share of the cohort; one NCCL all-reduce gives every rank the one-process FedAvg."""
    info = init_distributed()
    assert info.backend == "nccl" and info.device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    cohort = _cohort()
    acc = WeightedSum(ShapesAndDtypes.of(cohort[0][0]), FoldConfig(accumulate_dtype="float64", num_workers=1))
    for arrays, n in cohort[rank::world]:
        acc.fold(arrays, n)
    all_reduce_weighted_sum(acc)
    single = fedavg(iter(cohort), FoldConfig(accumulate_dtype="float64", num_workers=1))
    diff = max(float(np.abs(a - b).max()) for a, b in zip(acc.mean(), single))
    return {"backend": info.backend, "count": acc.count, "total": acc.total_weight,
            "expected_total": float(sum(n for _, n in cohort)), "max_diff": diff}


def check_fsdp2_bf16_mixed_precision_on_cuda():
    """FSDP2 with bf16 parameters and fp32 reduction on the GPU: bf16 forward, fp32 gradients, close to fp32 dense."""
    info = init_distributed()
    torch.manual_seed(0)
    dense = TinyMLP().to(info.device)
    torch.manual_seed(0)
    sharded = apply_fsdp(TinyMLP().to(info.device), init_device_mesh("cuda", (dist.get_world_size(),)),
                         mixed_precision_policy("bf16"))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 16, generator=g).to(info.device), torch.randint(0, 4, (32,), generator=g).to(info.device)
    opt_d, opt_s = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (dense, sharded))
    out_dtype = grad_dtype = None
    for _ in range(5):
        for model, opt in ((dense, opt_d), (sharded, opt_s)):
            opt.zero_grad()
            logits = model(x)
            if model is sharded:
                out_dtype = str(logits.dtype)
            F.cross_entropy(logits.float(), y).backward()
            if model is sharded:
                grad_dtype = str(next(model.parameters()).grad.dtype)
            opt.step()
    full = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
    diff = max((full[k].float() - v.float()).abs().max().item() for k, v in dense.state_dict().items())
    return {"out_dtype": out_dtype, "grad_dtype": grad_dtype, "max_param_diff": diff}


def check_trainer_bf16_autocast_on_cuda():
    """The engine's Trainer on the GPU in ``auto`` precision: bf16 autocast (DDP or one rank), and it learns."""
    info = init_distributed()
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 4, generator=g)
    x, ex = torch.randn(256, 16, generator=g), torch.randn(64, 16, generator=g)
    data = TrainData(x, (x @ w).argmax(1), ex, (ex @ w).argmax(1), CLASSIFICATION)
    out = Path(tempfile.gettempdir()) / f"fedpar-cuda-check-{dist.get_world_size()}"
    cfg = TrainConfig(model="mlp", dataset="synthetic", out=str(out), batch_size=32, epochs=8, lr=0.1,
                      optimizer="sgd", log_every=1000, plot=False, device="cuda", parallel=ParallelConfig())
    trainer = Trainer(cfg, TinyMLP, data, info)
    summary = trainer.run()
    return {"precision": trainer.precision, "backend": summary["backend"], "device": summary["device"],
            "autocast": uses_autocast(trainer.config.parallel),
            "test_accuracy": summary["test_accuracy"], "peak_memory_source": summary["peak_memory_source"]}
