"""Helpers for multi-process tests and benchmarks: a tiny model, dense clipped-step references, a spawn harness."""

from __future__ import annotations

import importlib.util
import json
import math
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedpar.models.losses import language_model_loss as lm_loss  # noqa: F401 (the name tests import)
from fedpar.parallel.init import init_distributed, shutdown_distributed, spawn
from fedpar.parallel.optim import clip_gradients, total_grad_norm
from fedpar.parallel.device import flush_denormals

CLIP_LR = 0.1


class TinyMLP(nn.Sequential):
    """in -> hidden -> hidden -> classes with ReLU (and optional dropout, to exercise RNG restore)."""

    def __init__(self, n_in: int = 16, hidden: int = 32, n_out: int = 4, dropout: float = 0.0) -> None:
        """Three Linear layers (the last stays replicated under TP)."""
        super().__init__(nn.Linear(n_in, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, n_out))


def local_numel(t: torch.Tensor) -> int:
    """Elements this rank actually stores for ``t`` (the local shard of a DTensor)."""
    return t.to_local().numel() if hasattr(t, "to_local") else t.numel()


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor (collective), or ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over the keys of ``a`` (missing keys count as infinite)."""
    worst = 0.0
    for k, v in a.items():
        if k not in b:
            return math.inf
        worst = max(worst, (v.detach().float() - b[k].detach().float()).abs().max().item())
    return worst


def dense_clipped_sgd_step(ref: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn) -> tuple[float, float]:
    """One SGD step of ``ref`` with its gradients clipped to half their norm; returns (norm, max_norm)."""
    loss_fn(ref(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf).item()  # max_norm inf: measure only
    max_norm = norm / 2
    torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    torch.optim.SGD(ref.parameters(), lr=CLIP_LR).step()
    return norm, max_norm


def clipped_sgd_step(params: list[nn.Parameter], max_norm: float, pp_group=None) -> dict[str, float]:
    """clip_gradients then one SGD step on this rank's (sharded or staged) parameters."""
    local_norm = total_grad_norm(params).item()  # without the pipeline all-reduce: this rank's stages only
    norm = clip_gradients(params, max_norm, pp_group)
    clipped_norm = total_grad_norm(params, pp_group).item()
    torch.optim.SGD(params, lr=CLIP_LR).step()
    return {"norm": norm, "local_norm": local_norm, "clipped_norm": clipped_norm}


def gpus_for_ranks(nproc: int) -> bool:
    """True when this machine has a CUDA GPU for each of ``nproc`` local ranks (so NCCL can join them)."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= nproc


def backend_id(device: str) -> str:
    """The backend a group on ``device`` uses, for test ids: ``"nccl"`` on GPUs, ``"gloo"`` on the CPU."""
    return "nccl" if device.startswith("cuda") else "gloo"


def _worker(checks_file: str, names: list[str], out_dir: str, device: str) -> None:
    info = init_distributed(timeout_seconds=60, device=device)
    flush_denormals()
    spec = importlib.util.spec_from_file_location(f"fedpar_checks_{Path(checks_file).stem}", checks_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results: dict[str, Any] = {}
    out = Path(out_dir) / f"rank{info.rank}.json"
    try:
        for name in names:
            start = time.perf_counter()
            try:
                results[name] = getattr(module, name)()
                results[name]["seconds"] = round(time.perf_counter() - start, 3)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
                raise  # the peers fail fast on the closed connection rather than wait in a collective
            finally:
                out.write_text(json.dumps(results))
        torch.distributed.barrier()  # leave together (rank 0 hosts the store; see parallel/run.py)
    finally:
        shutdown_distributed()


def run_checks(nproc: int, checks_file: str | Path, names: list[str], out_dir: str | Path,
               device: str = "cpu") -> list[dict[str, Any]]:
    """Run check functions ``names`` of ``checks_file`` in one spawned group on ``device``; return each rank's results.

    Every check returns a JSON-able dict of numbers. A failing check stops the group; its traceback is kept
    in the results of the ranks that raised, and later checks are missing.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    error: BaseException | None = None
    try:
        spawn(nproc, _worker, str(checks_file), list(names), str(out_dir), device)
    except Exception as exc:  # keep partial results; the tests report which check failed and why
        error = exc
    results = []
    for r in range(nproc):
        path = out_dir / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.is_file() else {})
    if error is not None and not any(results):
        raise error
    return results
