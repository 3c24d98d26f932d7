"""Run outputs: per-rank memory figures, metrics.jsonl and summary.json (rank 0 only), and the loss-curve PNG."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fedpar.protocol.atomicfile import atomic_write_bytes
from fedpar.protocol.run_logs import TensorBoardScalars, clean_row, write_csv


def reset_peak_memory(device: torch.device) -> None:
    """Start the GPU peak-memory count afresh (the trainer calls it when training starts); CPU peaks cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """This process's peak memory and how it was measured.

    GPU: ``torch.cuda.max_memory_allocated`` since ``reset_peak_memory``. CPU: the peak resident set size from
    ``getrusage`` (ru_maxrss; kilobytes on Linux, bytes on macOS); it includes the interpreter and torch itself
    (about 0.3 GB).
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "torch.cuda.max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "getrusage(RUSAGE_SELF).ru_maxrss"


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def model_state_bytes(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes of parameters, gradients and optimizer state this rank holds (local shards only)."""
    total = 0
    for part in parts:
        for p in part.parameters():
            total += _local_bytes(p)
            if p.grad is not None:
                total += _local_bytes(p.grad)
    for opt in optimizers:
        for state in opt.state.values():
            total += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def gather_ints(value: int, device: torch.device) -> list[int]:
    """Every rank's ``value``, in rank order (collective)."""
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [int(t.item()) for t in out]


class StepMetricsLog:
    """A training run's metrics.jsonl: JSON lines per logged step and evaluation, on rank 0; a no-op elsewhere."""

    def __init__(self, out_dir: Path, enabled: bool, resume_step: int = 0, tensorboard: str | None = None) -> None:
        """Open the log; on resume, drop lines written after ``resume_step`` by the interrupted run. With
        ``tensorboard``, every record's numbers also go there as scalars at its step (and, on resume, the events of the
        steps after ``resume_step`` that the interrupted run wrote there are dropped too)."""
        self.path = out_dir / "metrics.jsonl"
        self.enabled = enabled
        purge = resume_step + 1 if resume_step else None
        self.tensorboard = TensorBoardScalars(tensorboard, "step", purge_step=purge) if enabled and tensorboard else None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        if resume_step and self.path.is_file():
            kept = [json.dumps(record) for record in read_records(self.path)  # a line torn by a kill: dropped
                    if record.get("step", 0) <= resume_step]
            atomic_write_bytes(self.path, [(line + "\n").encode() for line in kept])
        elif not resume_step:  # no file until the first record: a run killed before one leaves none in the way of
            self.path.unlink(missing_ok=True)  # the earlier run's, set aside (simulations/run_outputs.py EarlierRun)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record."""
        if self.enabled:
            with self.path.open("a") as fh:
                fh.write(json.dumps(clean_row(record), allow_nan=False) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def close(self) -> None:
        """Write metrics.csv beside metrics.jsonl (every record so far) and close the TensorBoard events."""
        if self.enabled:
            write_csv(self.path.with_suffix(".csv"), self.records())
        if self.tensorboard is not None:
            self.tensorboard.close()

    def records(self) -> list[dict[str, Any]]:
        """All records written so far (rank 0)."""
        return read_records(self.path)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (none if it is missing); a last line torn by a killed writer is skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def write_interrupted_summary(out_dir: Path, model: str, dataset: str, world_size: int, wall_seconds: float,
                              config: dict[str, Any], kept_step: int | None = None) -> dict[str, Any]:
    """summary.json (and metrics.csv, once a step was logged) of a run stopped by Ctrl-C, from what its metrics.jsonl
    holds: the steps (those of the model kept, ``kept_step``, else the last logged), the last evaluation and train
    loss, each with the step it was taken at (``evaluated_at_step``, ``train_loss_at_step``: earlier than ``steps``
    when the stop came between two evaluations or logged steps; None when there was none); ``"interrupted": true``.
    Returns the summary."""
    records = read_records(out_dir / "metrics.jsonl")
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    last_eval = {k: v for k, v in evals[-1].items() if k not in ("kind", "step", "epoch")} if evals else {}
    summary = {"model": model, "dataset": dataset, "world_size": world_size, "interrupted": True,
               "steps": kept_step if kept_step is not None else train[-1]["step"] if train else 0,
               "evaluated_at_step": evals[-1].get("step") if evals else None, **last_eval,
               "final_train_loss": train[-1]["loss"] if train else None,
               "train_loss_at_step": train[-1]["step"] if train else None, "wall_seconds": wall_seconds,
               "config": config}
    out_dir.mkdir(parents=True, exist_ok=True)
    if records:  # else a table of no columns: one empty line, which CSV readers refuse
        write_csv(out_dir / "metrics.csv", records)
    write_json_atomic(out_dir / "summary.json", summary)
    return summary


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` as indented strict JSON (NaN and infinities as null) with
    :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, [(json.dumps(clean_row(data), indent=2, allow_nan=False) + "\n").encode()])


def plot_loss_curve(records: list[dict[str, Any]], path: Path, title: str) -> None:
    """Training loss against step (and the evaluation metric per epoch) as a PNG, with the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train" and "loss" in r]
    evals = [(r["step"], r.get("val_loss", r.get("test_loss"))) for r in records if r.get("kind") == "eval"]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    evals = [(s, v) for s, v in evals if v is not None]
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
