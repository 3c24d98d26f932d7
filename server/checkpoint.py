"""Coordinator checkpoints: one directory per completed round, published by an atomic LATEST pointer.

Tensors go into safetensors-layout files and everything else into JSON, so a checkpoint is read
without pickle. A crash at any moment leaves LATEST pointing at a complete checkpoint.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedpar.protocol.tensorfile import atomic_write_bytes, load_tensors, save_tensors

LATEST = "LATEST"
KEEP = 2


@dataclass
class Checkpoint:
    """What the coordinator needs to resume after its last completed round."""

    round_id: int
    names: list[str]
    arrays: list[np.ndarray]
    strategy_arrays: dict[str, np.ndarray]
    state: dict  # sampler RNG, strategy metadata, registry snapshot, counters


def save_checkpoint(root: Path, ckpt: Checkpoint) -> Path:
    """Write ``ckpt`` under ``root`` and make it the latest; old checkpoints beyond KEEP are removed."""
    root.mkdir(parents=True, exist_ok=True)
    name = f"round-{ckpt.round_id:06d}"
    target = root / name
    staging = root / f".{name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    save_tensors(staging / "global.safetensors", ckpt.names, ckpt.arrays, {"round": str(ckpt.round_id)})
    keys = sorted(ckpt.strategy_arrays)
    save_tensors(staging / "strategy.safetensors", keys, [ckpt.strategy_arrays[k] for k in keys])
    atomic_write_bytes(staging / "state.json", [json.dumps({"round": ckpt.round_id, **ckpt.state}).encode()])
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    atomic_write_bytes(root / LATEST, [name.encode()])
    for old in sorted(root.glob("round-*"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def load_checkpoint(root: Path) -> Checkpoint | None:
    """The latest checkpoint under ``root``, or None if there is none."""
    pointer = root / LATEST
    if not pointer.exists():
        return None
    directory = root / pointer.read_text().strip()
    if not directory.name.startswith("round-") or not directory.is_dir():
        raise ValueError(f"{pointer} points at {directory}, which is not a checkpoint directory")
    names, arrays, _ = load_tensors(directory / "global.safetensors")
    skeys, sarrays, _ = load_tensors(directory / "strategy.safetensors")
    state = json.loads((directory / "state.json").read_text())
    if not isinstance(state, dict) or not isinstance(state.get("round"), int):
        raise ValueError(f"{directory / 'state.json'} has no integer 'round'")
    return Checkpoint(state.pop("round"), names, arrays, dict(zip(skeys, sarrays)), state)
