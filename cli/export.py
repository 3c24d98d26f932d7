"""Write a fedpar model as a torch state_dict file.

SOURCE is a run's --out folder (its global.safetensors, taken before a checkpoint LATEST in the same folder), a
global.safetensors file, or a coordinator checkpoint directory (--checkpoint-dir: its latest round). The line it prints
names the file (or checkpoint) it read and its round. The file written holds a dict of tensors by state_dict name:
torch.load(FILE, weights_only=True) reads it and model.load_state_dict takes it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from fedpar.cli.declared import add_declared
from fedpar.cli.user_errors import UserError, check_folder_writable
from fedpar.settings import setting


@dataclass
class ExportOptions:
    """Where ``fedpar export`` writes the model (SOURCE, what it reads, is its one positional argument)."""

    to: Path | None = setting(None, metavar="FILE", check="file_path",
                              help="the torch state_dict file to write (e.g. model.pt); replaced if it exists")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``fedpar export``."""
    p.add_argument("source", type=Path, metavar="SOURCE",
                   help="a run's --out folder, a global.safetensors file, or a coordinator checkpoint directory")
    add_declared(p, ExportOptions, required=("to",))


def run(args: argparse.Namespace) -> int:
    """Read the model at ``args.source`` and torch.save its state_dict to ``args.to``."""
    import torch

    from fedpar.protocol.atomicfile import atomic_path
    from fedpar.server.checkpoint import CheckpointError
    from fedpar.server.final_model import read_final_model

    if not args.source.exists():
        run_id = str(args.source)
        service = (f" (a service's run {run_id}? 'fedpar run get {run_id} --out DIR' downloads its model, then export "
                   "DIR)") if run_id.isdigit() else ""
        raise UserError(f"{args.source} does not exist; give a run's --out folder, a global.safetensors file or "
                        f"a coordinator checkpoint directory{service}")
    if args.to.is_dir():
        raise UserError(f"--to {args.to} is a folder; name the file to write, e.g. {args.to / 'model.pt'}")
    _check_folders_of(args.to)
    check_folder_writable(args.to.parent, "--to")  # was said only after the model was read, and as exit 1
    _check_ended(args.source)
    if _reads(args.source.resolve(), args.to.resolve()):  # the model read would be overwritten by its export
        raise UserError(f"--to {args.to} is a file of what is exported ({args.source}): writing it would replace "
                        f"the model itself; write the export elsewhere, e.g. --to "
                        f"{args.source.resolve().parent / 'model.pt'}")
    if args.to.suffix == ".safetensors":  # a torch file by that name: safetensors readers refuse it
        raise UserError(f"--to {args.to}: export writes a torch state_dict file (torch.save), not safetensors; name "
                        f"a .pt file, e.g. --to {args.to.with_suffix('.pt')} (a run's global.safetensors already is "
                        "its model as safetensors: copy that)")
    try:
        kept = read_final_model(args.source)
    except CheckpointError as exc:  # its advice is a resume's: export resumes nothing
        raise UserError(f"cannot export the latest checkpoint in {args.source}: {exc.what}; "
                        f"{_instead_of_latest(args.source)}") from None
    except ValueError as exc:  # CodecError: the message names the file
        raise UserError(f"{args.source} is not a fedpar model: {exc}") from None
    state_dict = {name: torch.from_numpy(array) for name, array in zip(kept.names, kept.arrays)}
    args.to.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(args.to) as tmp:
        torch.save(state_dict, tmp)
    params = sum(a.size for a in kept.arrays)
    print(f"wrote {args.to}: {len(kept.names)} tensors, {params:,} parameters, from {_taken(args.source, kept)}")
    return 0


def _taken(source: Path, kept) -> str:
    """Which model of ``source`` was exported, and its round (a folder's global.safetensors is taken before a
    checkpoint LATEST beside it: then what of that checkpoint was not)."""
    from fedpar.protocol.model_file import TENSORS
    from fedpar.server.checkpoint import LATEST

    if kept.path.parent == source and kept.path.name != TENSORS:  # a checkpoint directory's LATEST round folder
        return f"{kept.origin()}, its latest checkpoint"
    if kept.path != source / TENSORS or not (source / LATEST).is_file():
        return kept.origin()
    return f"{kept.origin()}, {_beside(source, kept.round_id)}"


def _beside(source: Path, round_id: int | None) -> str:
    """What a folder's checkpoint LATEST names, beside the global.safetensors exported instead, and how to export
    it."""
    from fedpar.server.checkpoint import LATEST, checkpoint_name, latest_round

    try:
        other = latest_round(source)
    except ValueError:  # a LATEST that cannot be read (CheckpointError): exporting the folder never reads it
        other = None
    if other is None:
        return f"not the checkpoint that {source / LATEST} names"
    folder = source / checkpoint_name(other)
    if other == round_id:
        return f"the same round as the latest checkpoint beside it, {folder}"
    return f"not the latest checkpoint beside it, {folder} (round {other}): export {folder} for that one"


def _instead_of_latest(source: Path) -> str:
    """What to export instead of the checkpoint directory ``source`` whose latest checkpoint cannot be read: the
    newest other round folder that holds a model, or the run's own model."""
    from fedpar.protocol.model_file import TENSORS
    from fedpar.server.checkpoint import LATEST

    pointer = source / LATEST
    named = pointer.read_bytes().decode("ascii", "replace").strip() if pointer.is_file() else ""
    rounds = sorted(p for p in source.glob("round-*") if p.name != named and (p / TENSORS).is_file())
    ended = f"the run's --out folder (its {TENSORS}, written as the run ended)"
    if not rounds:
        return f"export {ended} instead"
    return f"export an earlier round instead, {rounds[-1]}, or {ended}"


def _check_folders_of(to: Path) -> None:
    """UserError when a file stands where a folder of ``to`` would be (it cannot be made there)."""
    blocker = next((part for part in to.parents if part.exists() and not part.is_dir()), None)
    if blocker is not None:
        raise UserError(f"--to {to}: {blocker} is a file, not a folder; write the export into a folder, e.g. --to "
                        f"{blocker.parent / to.name}")


def _check_ended(source: Path) -> None:
    """UserError when ``source`` (or the folder of the global.safetensors it names) is a running run's --out."""
    from fedpar.cli.user_errors import OUTPUT_LOCK
    from fedpar.protocol.file_lock import LockHeld, check_free
    from fedpar.protocol.model_file import TENSORS

    folder = source if source.is_dir() else source.parent if source.name == TENSORS else None
    try:
        if folder is not None:
            check_free(folder / OUTPUT_LOCK)
    except LockHeld as held:
        pid = f" (pid {held.pid})" if held.pid else ""
        there = "the one there now is an earlier run's" if (folder / TENSORS).is_file() else "there is none yet"
        raise UserError(f"{folder} is the --out folder of a run still running{pid}: it writes its {TENSORS} as it "
                        f"ends, and {there}; wait for it to end, or export its --checkpoint-dir for its latest "
                        "round") from None


def _reads(source: Path, to: Path) -> bool:
    """Whether ``to`` is a file the export of ``source`` reads: the file itself (a global.safetensors: global.json
    beside it too), a run folder's model files, or a checkpoint directory's (its LATEST and round folders)."""
    from fedpar.protocol.model_file import INFO, TENSORS
    from fedpar.server.checkpoint import LATEST

    if to == source or (source.name == TENSORS and to == source.with_name(INFO)):
        return True
    if not source.is_dir() or source not in to.parents:
        return False
    first = to.relative_to(source).parts[0]
    return first in (TENSORS, INFO, LATEST) or first.startswith("round-")
