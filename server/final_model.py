"""The global model a run keeps: ``global.safetensors`` and ``global.json`` in its ``--out`` folder.

``fedpar serve`` and ``fedpar simulate`` write them at the end of a run (also after Ctrl-C, once a round has
completed), whether or not checkpoints are on; ``fedpar export`` reads them, or a coordinator checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedpar.protocol.model_file import TENSORS, write_final_model
from fedpar.protocol.tensorfile import load_tensors
from fedpar.server.checkpoint import LATEST, load_checkpoint_model


def write_coordinator_model(out: Path, coordinator, model: dict, interrupted: bool = False) -> bool:
    """:func:`write_final_model` for a coordinator's current global model, its round and that round's metrics line.

    A coordinator stopped while closing a round holds that round's model (the model and the round number change
    together) but may not have logged its line yet: then ``metrics`` is None.
    """
    row = coordinator.metrics.last
    row = row if row and row.get("round") == coordinator.round_id else None
    return write_final_model(out, coordinator.names, coordinator.weights, coordinator.round_id, model, row,
                             interrupted)


@dataclass
class KeptModel:
    """A kept global model: its tensors, the file (or checkpoint round folder) they were read from, and the round
    they are the model after (None: the file does not say)."""

    names: list[str]
    arrays: list[np.ndarray]
    path: Path
    round_id: int | None

    def origin(self) -> str:
        """'PATH (round N)': where the model was read from, and its round."""
        return str(self.path) if self.round_id is None else f"{self.path} (round {self.round_id})"


def load_final_model(source: Path) -> tuple[list[str], list[np.ndarray]]:
    """The names and arrays of the model at ``source`` (see :func:`read_final_model`)."""
    kept = read_final_model(source)
    return kept.names, kept.arrays


def read_final_model(source: Path) -> KeptModel:
    """The model at ``source``: a safetensors file, a folder holding global.safetensors (an ``--out`` folder or one
    checkpoint round: the folder's global.safetensors is taken before a checkpoint LATEST beside it), or a checkpoint
    directory (its LATEST round).

    Raises FileNotFoundError when ``source`` is missing, ValueError (CodecError, CheckpointError) when it is not
    a model fedpar can read.
    """
    source = Path(source)
    if source.is_dir():
        if (source / TENSORS).is_file():
            source = source / TENSORS
        elif (source / LATEST).is_file():
            round_id, names, arrays, directory = load_checkpoint_model(source)  # the rest is a resume's
            return KeptModel(names, arrays, directory, round_id)
        else:
            raise ValueError(_not_a_model_folder(source))
    names, arrays, meta = load_tensors(source)
    if not names:
        raise ValueError(f"{source} holds no tensors")
    said = meta.get("round", "")
    return KeptModel(names, arrays, source, int(said) if said.isdigit() else None)


def _not_a_model_folder(source: Path) -> str:
    """Why folder ``source`` holds no model export reads, and what to give instead."""
    from fedpar.parallel.checkpoint import LATEST as TRAIN_LATEST

    if (source / "checkpoints" / TRAIN_LATEST).is_file():  # a `fedpar train` --out folder, its run not ended
        whole = _latest_whole_model(source / "checkpoints")
        export = f"; export {whole}, its latest checkpoint's model" if whole is not None else ""
        return (f"{source} is the --out folder of a `fedpar train` run that has not ended (it writes its {TENSORS} as "
                f"it ends): the same command resumes it{export}")
    if (source / TRAIN_LATEST).is_file():
        ended = (f"the run's --out folder, {source.parent}, whose {TENSORS} the run wrote as it ended (a run stopped "
                 "before its end wrote none: the same command resumes it)")
        whole = _latest_whole_model(source)
        if whole is not None:
            return f"{source} is a `fedpar train --task` checkpoint directory; export {whole}, its latest, or {ended}"
        return (f"{source} is a `fedpar train` checkpoint directory (sharded DCP checkpoints, not one model); "
                f"export {ended}")
    if (source / "checkpoints" / LATEST).is_file():  # a service's run folder (STATE.runs/ID), or serve's --out
        return (f"{source} holds no {TENSORS}: its run has not ended (a run writes it as it ends; one killed with kill "
                f"-9 never does); export {source / 'checkpoints'} for its latest checkpoint's model")
    return f"{source} holds neither {TENSORS} (a run's --out folder) nor {LATEST} (a coordinator checkpoint directory)"


def _latest_whole_model(checkpoints: Path) -> Path | None:
    """The whole model of the checkpoint ``checkpoints/latest`` names, when it holds one (`fedpar train --task`'s
    do; the zoo trainer's are sharded DCP checkpoints)."""
    from fedpar.parallel.checkpoint import LATEST as TRAIN_LATEST
    from fedpar.parallel.epoch_checkpoint import MODEL_FILE

    whole = checkpoints / (checkpoints / TRAIN_LATEST).read_text(errors="replace").strip() / MODEL_FILE
    return whole if whole.is_file() else None
