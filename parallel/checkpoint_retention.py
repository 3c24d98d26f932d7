"""Which checkpoints of a run directory stay: the newest ones of the run that writes them, never the one ``latest``
names. Used by parallel/checkpoint.py (``step-NNNNNNNN``) and parallel/epoch_checkpoint.py (``epoch-NNNNNN``).

A run's checkpoints are the one it resumed from, those before it, and the ones this process wrote since (folder
names are zero-padded: their order is the order of their steps). A run that starts afresh (--no-resume, or nothing
to resume) over an earlier run's checkpoints removes them once its own first one is complete and named in
``latest`` (a crash before leaves them and a resumable folder), and says so in one line; they were kept by step
number before, and a fresh run's own checkpoints, numbered below the earlier run's, were the ones removed (``latest``
then named a folder that was gone). Call :func:`prune` from one process of a run only (rank 0).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from fedpar.parallel.stopping import held_stops
from fedpar.protocol.atomicfile import atomic_write_bytes

# this process's run, by checkpoint directory: the names of its checkpoints, oldest first
_RUNS: dict[Path, list[str]] = {}


def _key(directory: str | Path) -> Path:
    return Path(directory).resolve()


def resumed(directory: str | Path, name: str, pattern: str) -> None:
    """Note that this process's run resumed from the checkpoint ``name`` in ``directory``: it and the ``pattern``
    folders before it are the run's so far."""
    before = [p.name for p in Path(directory).glob(pattern) if p.is_dir() and p.name < name]
    _RUNS[_key(directory)] = sorted(before) + [name]


def prune(directory: str | Path, written: str, pattern: str, keep: int) -> list[str]:
    """After the checkpoint ``written`` is complete and named in ``directory/latest``: remove the ``pattern`` folders
    that are not among this run's newest ``keep`` (``keep`` <= 0: keep all); the names removed. One line on stdout
    names those of an earlier run. The folder ``latest`` names is never removed, and what a stopped save left half
    written (``pattern.partial``) always is."""
    directory = Path(directory)
    for stale in directory.glob(pattern + ".partial"):  # never named: the one just written is complete
        shutil.rmtree(stale, ignore_errors=True)
    if keep <= 0:
        return []
    run = _RUNS.get(_key(directory), [])
    if run and run[-1] > written:  # a new run in this same process (steps of one run only grow)
        run = []
    if written not in run:
        run.append(written)
    _RUNS[_key(directory)] = run
    pointer = directory / "latest"
    named = pointer.read_text().strip() if pointer.is_file() else written
    kept = set(run[-keep:]) | {named}
    others = sorted(p.name for p in directory.glob(pattern) if p.is_dir() and p.name not in kept)
    earlier = [name for name in others if name not in run]
    for name in others:
        shutil.rmtree(directory / name, ignore_errors=True)
    _RUNS[_key(directory)] = [name for name in run if name in kept]
    if earlier:
        print(f"removed {len(earlier)} checkpoint(s) of an earlier run in {directory}: {', '.join(earlier)} "
              f"(this run's {written} is latest)", flush=True)
    return others


def put_in_place(staged: Path, target: Path, pointer: Path) -> None:
    """Give the complete checkpoint folder ``staged`` the name ``target`` and write that name into ``pointer``
    (``latest``), a stop signal held until both are done. A folder already of that name (an earlier run's, which the
    ``latest`` a fresh run set aside may name, put back if this run is stopped) is replaced whole, never written
    into or removed before the new one is complete."""
    old = set_aside(target)
    restore_set_aside(target)  # a swap a kill -9 cut short: the folder it set aside is the one to replace
    shutil.rmtree(old, ignore_errors=True)
    with held_stops():  # between the two renames no folder has the name: a stop there would leave `latest` dangling
        if target.exists():
            target.rename(old)
        staged.rename(target)
        atomic_write_bytes(pointer, [(target.name + "\n").encode()])
    shutil.rmtree(old, ignore_errors=True)


def set_aside(target: Path) -> Path:
    """Where :func:`put_in_place` sets aside the folder named ``target`` while it renames the new one in."""
    return target.with_name(target.name + ".old")


def restore_set_aside(target: Path) -> None:
    """Give the folder :func:`put_in_place` set aside its name ``target`` back, where a kill -9 (which no held stop
    holds) came between the two renames: ``latest`` may name ``target``, and the set-aside folder is what it named."""
    old = set_aside(target)
    if not target.exists() and old.is_dir():
        try:
            old.rename(target)
        except FileNotFoundError:  # another rank of the run gave it back first
            pass
