"""Checkpoints of a loop that trains one epoch at a time (`fedpar train --task`): after an epoch, the whole model's
weights (safetensors), the loop's counters and the RNG, so the same command resumes at the next epoch.

A checkpoint directory holds ``epoch-NNNNNN/`` folders (``model.safetensors``, ``state.safetensors`` with the
counters and the RNG state as tensors, ``run.json``: what a resume must match) and a ``latest`` file naming the
newest complete one, replaced atomically after the folder is written. Nothing is pickled.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from fedpar.parallel import checkpoint_retention
from fedpar.protocol.run_record import RUN_RECORD, check_settings, record_settings

LATEST = "latest"
MODEL_FILE, STATE_FILE = "model.safetensors", "state.safetensors"
RNG_KEY = "rng.cpu"
_EPOCH_NAME = re.compile(r"epoch-\d{6}")
_EPOCH_GLOB = "epoch-??????"
_STEP_NAME = re.compile(r"step-\d{8}")  # parallel/checkpoint.py's (the zoo trainer's)


class EpochCheckpointError(ValueError):
    """A checkpoint that cannot be resumed, with what to do instead."""


def is_epoch_checkpoint(name: str) -> bool:
    """Whether ``name`` is the folder name of a task's epoch checkpoint (``epoch-NNNNNN``)."""
    return bool(_EPOCH_NAME.fullmatch(name))


def epoch_dir(directory: Path, epoch: int) -> Path:
    """The folder of the checkpoint taken after ``epoch`` epochs."""
    return Path(directory) / f"epoch-{epoch:06d}"


def save_epoch_checkpoint(directory: Path, model: nn.Module, counters: dict[str, float], record: dict,
                          keep: int = 2) -> Path:
    """Keep ``model``'s weights, ``counters`` (``epoch`` among them) and this process's RNG after an epoch, with
    ``record`` (the settings a resume must match); only this run's newest ``keep`` checkpoints stay (an earlier
    run's are removed once this one is ``latest``: checkpoint_retention.py)."""
    target = epoch_dir(directory, int(counters["epoch"]))
    staged = target.with_name(target.name + ".partial")  # whole before it takes the name (a kill leaves no half)
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    save_model(model, str(staged / MODEL_FILE))  # tied weights once (save_file refuses shared tensors)
    state = {key: torch.tensor([float(value)], dtype=torch.float64) for key, value in counters.items()}
    save_file({**state, RNG_KEY: torch.get_rng_state()}, str(staged / STATE_FILE))
    record_settings(staged / RUN_RECORD, record)
    checkpoint_retention.put_in_place(staged, target, Path(directory) / LATEST)  # over an earlier run's (--no-resume)
    checkpoint_retention.prune(directory, target.name, _EPOCH_GLOB, keep)
    return target


def latest_epoch_checkpoint(directory: Path, afresh: str) -> Path | None:
    """The checkpoint ``directory/latest`` names (None: there is none yet); EpochCheckpointError, saying to do
    ``afresh`` instead, when it names no complete checkpoint."""
    pointer = Path(directory) / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    target = Path(directory) / name
    if _STEP_NAME.fullmatch(name):
        raise EpochCheckpointError(f"{pointer} names {name}, a checkpoint of `fedpar train` without --task (its zoo "
                                   f"trainer's), not of a task's epochs; {afresh}")
    if _EPOCH_NAME.fullmatch(name):
        checkpoint_retention.restore_set_aside(target)
    if not _EPOCH_NAME.fullmatch(name) or not (target / MODEL_FILE).is_file() or not (target / STATE_FILE).is_file():
        raise EpochCheckpointError(f"{pointer} names {name!r}, which holds no complete checkpoint ({MODEL_FILE} and "
                                   f"{STATE_FILE}); {instead(Path(directory), name, afresh)}")
    return target


def instead(directory: Path, damaged: str, afresh: str) -> str:
    """What to do instead of resuming the checkpoint named ``damaged``: the complete one before it, if any, or
    ``afresh``."""
    older = [p.name for p in sorted(directory.glob("epoch-??????"), reverse=True)
             if p.name < damaged and (p / MODEL_FILE).is_file() and (p / STATE_FILE).is_file()]
    return f"write {older[0]} into {directory / LATEST} to resume the one before it, or {afresh}" if older else afresh


def check_epoch_checkpoint(path: Path, record: dict, afresh: str) -> None:
    """EpochCheckpointError (one line) when the checkpoint at ``path`` was made with other settings than ``record``
    or its files do not read as safetensors."""
    try:
        check_settings(path / RUN_RECORD, record, source=str(path), afresh=afresh)
    except ValueError as exc:
        raise EpochCheckpointError(str(exc)) from None
    for name in (MODEL_FILE, STATE_FILE):
        try:
            with safe_open(str(path / name), "pt") as kept:
                kept.keys()
        except (SafetensorError, OSError) as exc:
            raise EpochCheckpointError(f"cannot resume from {path}: its {name} is damaged "
                                       f"({str(exc).splitlines()[0]}); {instead(path.parent, path.name, afresh)}"
                                       ) from None


def load_epoch_checkpoint(path: Path, model: nn.Module, afresh: str) -> dict[str, float]:
    """Load the checkpoint at ``path`` into ``model`` and this process's RNG; its counters. EpochCheckpointError when
    its files do not read or its weights are not ``model``'s (names, shapes)."""
    try:
        state = load_file(str(path / STATE_FILE))
        missing, unexpected = load_model(model, str(path / MODEL_FILE), strict=False)
    except (SafetensorError, OSError) as exc:
        raise EpochCheckpointError(f"cannot resume from {path}: {str(exc).splitlines()[0]}; {afresh}") from None
    except RuntimeError as exc:  # torch's 'Error(s) in loading state_dict for X:', then each weight that differs
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [repr(exc)]
        first = lines[1] if len(lines) > 1 else lines[0]
        raise EpochCheckpointError(f"cannot resume from {path}: its weights are another model's ({first}); {afresh}"
                                   ) from None
    if missing or unexpected:
        raise EpochCheckpointError(f"cannot resume from {path}: its weights are another model's (missing "
                                   f"{sorted(missing)[:3]}, unknown {sorted(unexpected)[:3]}); {afresh}")
    rng = state.pop(RNG_KEY, None)
    if rng is not None and rng.dtype == torch.uint8:
        torch.set_rng_state(rng)
    checkpoint_retention.resumed(path.parent, path.name, _EPOCH_GLOB)  # this run's checkpoints so far
    return {key: float(value.item()) for key, value in state.items() if value.numel() == 1}
