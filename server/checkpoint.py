"""Coordinator checkpoints: one directory per completed round, published by an atomic LATEST pointer.

Tensors go into safetensors files (protocol/tensorfile.py) and everything else into JSON, so a checkpoint is read
without pickle. The write order makes a crash at any moment harmless:

1. every file goes into ``.round-NNNNNN.partial/`` (temporary file, fsync, rename, fsync of the directory);
2. the staging directory is renamed to ``round-NNNNNN`` and the root directory is fsynced;
3. only then is ``LATEST`` replaced (temporary file, fsync, rename, fsync of the root).

So ``LATEST`` only ever names a complete, durable directory; leftovers of an interrupted write
(``.partial`` directories, ``.tmp-`` files, a round directory ``LATEST`` does not name yet) are ignored
on load and cleaned up by the next save.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedpar.protocol.codec import CodecError
from fedpar.protocol.file_lock import FileLock, LockHeld, hold
from fedpar.protocol.atomicfile import atomic_write_bytes, fsync_directory
from fedpar.protocol.tensorfile import load_tensors, save_tensors

LATEST = "LATEST"
LOCK = ".lock"  # held by the run that uses the folder (lock_folder)
KEEP = 2
FILES = ("global.safetensors", "strategy.safetensors", "state.json")
_NAME = re.compile(r"round-(\d{6,})")
# `fedpar train`'s checkpoint folders (parallel/checkpoint.py: step-NNNNNNNN, parallel/epoch_checkpoint.py:
# epoch-NNNNNN) and the file naming its latest (lower case: on a case-insensitive disk it is LATEST, naming a round)
_TRAINER_NAME = re.compile(r"step-\d{8}|epoch-\d{6}")
_TRAINER_LATEST = "latest"
MAX_STATE_BYTES = 256 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and what to do: ``what`` is wrong, then the
    ``advice`` on resuming (another checkpoint), which a reader that does not resume (export) says otherwise."""

    def __init__(self, what: str, advice: str = ""):
        super().__init__(what + advice)
        self.what, self.advice = what, advice


@dataclass
class Checkpoint:
    """What the coordinator needs to resume after its last completed round."""

    round_id: int
    names: list[str]
    arrays: list[np.ndarray]
    strategy_arrays: dict[str, np.ndarray]
    state: dict  # sampler RNG, strategy metadata, agents' example caps, the round's metrics row and run summary
    directory: Path | None = None  # where it was loaded from (None: not loaded from disk)

    @contextlib.contextmanager
    def restoring(self, entry: str) -> Iterator[None]:
        """Turn a failure to restore state.json's ``entry`` into a CheckpointError that names the file."""
        try:
            yield
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            where = self.directory / "state.json" if self.directory else "state.json"
            hint = _older_hint(self.directory.parent, self.round_id) if self.directory else ""
            raise CheckpointError(f"damaged checkpoint: {where}: its {entry!r} entry cannot be restored "
                                  f"({exc})", hint) from None


def checkpoint_name(round_id: int) -> str:
    """Directory name of the checkpoint taken after ``round_id``."""
    return f"round-{round_id:06d}"


def save_checkpoint(root: Path, ckpt: Checkpoint) -> Path:
    """Write ``ckpt`` under ``root`` and make it the latest; old checkpoints beyond KEEP are removed."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(ckpt.round_id)
    target = root / name
    staging = root / f".{name}.partial"
    if _read_pointer(root) == name:
        raise CheckpointError(f"{root / LATEST} already names {name}; refusing to overwrite the live checkpoint")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
        save_tensors(staging / "global.safetensors", ckpt.names, ckpt.arrays, {"round": str(ckpt.round_id)})
        keys = sorted(ckpt.strategy_arrays)
        save_tensors(staging / "strategy.safetensors", keys, [ckpt.strategy_arrays[k] for k in keys])
        atomic_write_bytes(staging / "state.json", [json.dumps({"round": ckpt.round_id, **ckpt.state}).encode()])
        # A round directory LATEST does not name is a leftover of a crash between rename and pointer update.
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        fsync_directory(root)  # the directory entry is durable before LATEST can name it
        atomic_write_bytes(root / LATEST, [name.encode()])
    except OSError as exc:  # a full disk, a quota, a folder made read-only: LATEST still names the last good one
        shutil.rmtree(staging, ignore_errors=True)
        raise OSError(exc.errno, exc.strerror, str(target)) from exc  # said of the checkpoint, not a temporary file
    _prune(root, keep_from=ckpt.round_id)
    return target


def note_resume(exc: BaseException, root: Path | None) -> None:
    """Add to ``exc`` (a run stopped by a file it could not write) which checkpoint under ``root`` is kept and that
    the same command resumes from it."""
    if root is None:
        return
    try:
        kept = _read_pointer(Path(root))
    except CheckpointError:
        kept = None
    exc.add_note(f"{kept} is kept; run the same command again to resume from it" if kept
                 else "no checkpoint was written yet")


def _prune(root: Path, keep_from: int) -> None:
    """Remove checkpoints older than the KEEP newest up to ``keep_from``, and crash leftovers."""
    rounds = sorted(int(m.group(1)) for p in root.iterdir() if (m := _NAME.fullmatch(p.name)))
    kept = [r for r in rounds if r <= keep_from][-KEEP:]
    for r in rounds:
        if r not in kept:
            shutil.rmtree(root / checkpoint_name(r), ignore_errors=True)
    for leftover in root.glob(".*.partial"):
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in root.glob(f".{LATEST}.tmp-*"):
        leftover.unlink(missing_ok=True)


def lock_folder(root: Path) -> FileLock:
    """Hold ``root``/.lock (the folder made if missing) for the life of the run that checkpoints there: another
    run writing the same checkpoints would resume from, and prune, this one's. CheckpointError, naming the other
    run's pid, when another process holds it."""
    root = Path(root)
    _check_folder(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        return hold(root / LOCK)
    except LockHeld as exc:
        raise CheckpointError(f"--checkpoint-dir {root} is in use by another fedpar run (pid {exc.pid}); wait for it "
                              "to end, or give another --checkpoint-dir") from None
    except OSError as exc:
        raise CheckpointError(f"--checkpoint-dir {root} cannot be used: {exc.strerror or exc}; give a folder this user "
                              "can write") from None


def check_checkpoint_dir(root: Path | None) -> None:
    """CheckpointError when --checkpoint-dir ``root`` is a file or holds `fedpar train`'s checkpoints (or is that
    command's --out folder); nothing for None, a new folder or a federated run's."""
    if root is not None:
        _check_folder(Path(root))


def _check_folder(root: Path) -> None:
    """CheckpointError when ``root`` is a file or `fedpar train`'s (a run here would write its rounds beside that
    run's checkpoints, and resume from neither)."""
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"the checkpoint directory {root} is a file; give a folder (a new one starts the run "
                              "over)")
    own = "give --checkpoint-dir a folder of its own (a new one starts the run over)"
    trainer = _trainer_checkpoints(root)
    if trainer:
        raise CheckpointError(f"--checkpoint-dir {root} holds checkpoints of `fedpar train` (centralized training: "
                              f"{', '.join(trainer[:3])}{', ...' if len(trainer) > 3 else ''}), not of a federated "
                              f"run; {own}")
    if _trainer_checkpoints(root / "checkpoints"):
        raise CheckpointError(f"--checkpoint-dir {root} is the --out folder of a `fedpar train` run (its checkpoints "
                              f"are in {root / 'checkpoints'}), not a federated run's checkpoints; {own}")


def _trainer_checkpoints(folder: Path) -> list[str]:
    """The `fedpar train` checkpoints in ``folder`` (parallel/checkpoint.py's step-NNNNNNNN folders,
    parallel/epoch_checkpoint.py's epoch-NNNNNN, or the one its ``latest`` file names), sorted; none if it is no
    folder."""
    try:
        names = {p.name.removesuffix(".partial") for p in folder.iterdir() if p.is_dir()}
        latest = (folder / _TRAINER_LATEST).read_bytes().decode("ascii", "replace").strip() \
            if (folder / _TRAINER_LATEST).is_file() else ""
    except OSError:
        return []
    return sorted(name for name in names | {latest} if _TRAINER_NAME.fullmatch(name))


def _read_pointer(root: Path) -> str | None:
    pointer = root / LATEST
    _check_folder(root)
    try:
        return pointer.read_bytes().decode("ascii").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{pointer} cannot be read ({exc})", "; restore it or delete the checkpoint "
                              "directory to start over") from None


def latest_round(root: Path | None) -> int | None:
    """The round the latest checkpoint under ``root`` was taken after, from its pointer alone; None if there is none."""
    name = _read_pointer(Path(root)) if root is not None else None
    match = _NAME.fullmatch(name) if name else None
    return int(match.group(1)) if match else None


def has_checkpoint(root: Path | None) -> bool:
    """Whether ``root`` names a latest checkpoint (a run there resumes from it)."""
    return root is not None and (Path(root) / LATEST).exists()


def load_checkpoint_model(root: Path) -> tuple[int, list[str], list[np.ndarray], Path] | None:
    """The global model of the latest checkpoint under ``root`` (its round, names, arrays and round folder), or None if
    there is none; raises CheckpointError if it is damaged. The rest of the checkpoint (the strategy's and the
    coordinator's state, which only a resume needs) is not read."""
    root = Path(root)
    name = _read_pointer(root)
    if name is None:
        return None
    pointer = root / LATEST
    match = _NAME.fullmatch(name)
    directory = root / name
    if match is None or not directory.is_dir():
        raise CheckpointError(f"{pointer} names {name!r}, which is not a checkpoint directory in {root}",
                              _older_hint(root, None))
    if directory.is_symlink() or directory.resolve().parent != root.resolve():
        raise CheckpointError(f"{pointer} names {name!r}, which is a link to {directory.resolve()}, outside {root}; "
                              f"checkpoints are read only from real directories in it", _older_hint(root, None))
    round_id = int(match.group(1))
    names, arrays, meta = _checkpoint_tensors(directory / "global.safetensors", root, round_id)
    if meta.get("round") != str(round_id):
        raise CheckpointError(f"{directory}: global.safetensors says round {meta.get('round')!r}, but the directory "
                              f"is for round {round_id}", _older_hint(root, round_id))
    for tensor_name, array in zip(names, arrays):
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise CheckpointError(f"{directory / 'global.safetensors'}: tensor {tensor_name!r} holds NaN or Inf",
                                  _older_hint(root, round_id))
    return round_id, names, arrays, directory


def _checkpoint_tensors(path: Path, root: Path, round_id: int) -> tuple[list[str], list[np.ndarray], dict]:
    """The tensors of the file ``path`` of round ``round_id``'s checkpoint under ``root``; CheckpointError (with what
    to do instead) when it is missing or damaged."""
    try:
        return load_tensors(path)
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint file {exc.filename} is missing", _older_hint(root, round_id)) from None
    except CodecError as exc:  # the message starts with the file's path
        raise CheckpointError(f"damaged checkpoint: {exc}", _older_hint(root, round_id)) from None


def load_checkpoint(root: Path) -> Checkpoint | None:
    """The latest checkpoint under ``root``, or None if there is none; raises CheckpointError if it is damaged."""
    root = Path(root)
    model = load_checkpoint_model(root)
    if model is None:
        return None
    round_id, names, arrays, directory = model
    skeys, sarrays, _ = _checkpoint_tensors(directory / "strategy.safetensors", root, round_id)
    state = _load_state(directory / "state.json", root, round_id)
    if state.get("round") != round_id:
        raise CheckpointError(f"{directory}: state.json says round {state.get('round')!r}, but the directory is for "
                              f"round {round_id}", _older_hint(root, round_id))
    shapes = {"sampler": (dict,), "strategy": (dict,), "agents": (list,), "example_caps": (dict,),
              "metrics_row": (dict, type(None)), "metrics_summary": (dict,), "metrics_path": (str, type(None))}
    for entry, types in shapes.items():
        if (entry in state and not isinstance(state[entry], types)) or (entry == "sampler" and entry not in state):
            kinds = " or ".join({dict: "an object", list: "a list", str: "a string", type(None): "null"}[t]
                                for t in types)
            raise CheckpointError(f"damaged checkpoint: {directory / 'state.json'}: {entry!r} must be {kinds}",
                                  _older_hint(root, round_id))
    state.pop("round")
    return Checkpoint(round_id, names, arrays, dict(zip(skeys, sarrays)), state, directory)


def saved_strategy(root: Path | None) -> str | None:
    """The strategy the latest checkpoint under ``root`` was made with, from its state.json alone (None: no
    checkpoint, one that does not say, or a damaged one: :func:`load_checkpoint` says what is wrong with it)."""
    try:
        name = _read_pointer(Path(root)) if root is not None else None
        state = _load_state(Path(root) / name / "state.json", Path(root), 0) if name and _NAME.fullmatch(name) else {}
    except (CheckpointError, OSError):
        return None
    saved = state.get("strategy")
    return saved.get("strategy") if isinstance(saved, dict) and isinstance(saved.get("strategy"), str) else None


def strategy_refusal(root: Path, saved_by: str, name: str) -> str:
    """The line refusing to resume the checkpoint under ``root``, made with strategy ``saved_by``, with ``name``."""
    return (f"checkpoint in {root} was made with strategy {saved_by!r}, not {name!r}; resume with the --strategy (and "
            "--privacy) it was made with, or point --checkpoint-dir elsewhere")


def other_runs_refusal(metrics: Path, why: str, root) -> str:
    """The line refusing to resume the checkpoint under ``root`` into the folder of the metrics.jsonl ``metrics``,
    which holds another run's rows (``why``: run_logs.another_runs_rows): appended to, they would pass for one run."""
    out = Path(metrics).parent
    return (f"--out {out} holds another run's rows ({Path(metrics).name}: {why} in --checkpoint-dir {root}); resume "
            f"into another --out, or move {out}'s files away (the resumed run's rows then start at the checkpoint's "
            "round)")


def _load_state(path: Path, root: Path, round_id: int) -> dict:
    try:
        if path.stat().st_size > MAX_STATE_BYTES:
            raise CheckpointError(f"{path} is implausibly large ({path.stat().st_size} bytes)")
        state = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing", _older_hint(root, round_id)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"damaged checkpoint: {path} is not JSON ({exc})", _older_hint(root, round_id)) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"damaged checkpoint: {path} must hold a JSON object", _older_hint(root, round_id))
    return state


def _older_hint(root: Path, round_id: int | None) -> str:
    """Tell the operator how to fall back to an older complete checkpoint, if there is one."""
    older = sorted(p.name for p in root.iterdir() if _NAME.fullmatch(p.name)
                   and (round_id is None or int(_NAME.fullmatch(p.name).group(1)) < round_id))
    if not older:
        return "; move the checkpoint directory away to start from scratch"
    return (f"; to resume from the previous checkpoint instead, write {older[-1]!r} into {root / LATEST} "
            "(the rounds after it run again)")

