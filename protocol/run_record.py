"""The record a resumable run keeps beside its checkpoints (run.json): the settings it was made with, by flag, and the
check a resume makes against it. `fedpar simulate --checkpoint-dir` and `fedpar train`'s DCP checkpoints keep it.

A record holds ``defining`` settings, which a resume must match (another value makes another run: it is refused in
one line naming each difference), and ``noted`` ones, which only change how the rest of the run goes (each
difference is said in one line and the run resumes), plus the seconds the processes before this one ran.
"""

from __future__ import annotations

import json
from pathlib import Path

from fedpar.protocol.atomicfile import atomic_write_bytes

RUN_RECORD = "run.json"


class RunRecordError(ValueError):
    """A resume refused by its run record (other defining settings, or a record that cannot be read)."""


def record_settings(path: Path, defining: dict, noted: dict | None = None, seconds: float = 0.0) -> None:
    """Keep ``defining`` and ``noted`` (keyed by flag) and ``seconds`` (the processes' so far) as the run record at
    ``path``."""
    record = {"defining": _as_kept(defining), "noted": _as_kept(noted or {}), "seconds": float(seconds)}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(Path(path), [(json.dumps(record, indent=1, sort_keys=True) + "\n").encode()])


def read_record(path: Path, afresh: str) -> dict | None:
    """The run record at ``path`` (None: there is none, as for a checkpoint of older code); RunRecordError, saying
    to delete it or ``afresh``, when it cannot be read."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunRecordError(f"damaged checkpoint record: {path} ({exc}); delete it to resume without checking the "
                             f"settings, or {afresh}") from None
    return saved if isinstance(saved, dict) else {}


def check_settings(path: Path, defining: dict, noted: dict | None = None, *, source: str, afresh: str) -> list[str]:
    """RunRecordError, one line, when the record at ``path`` was made with ``defining`` settings other than these:
    each difference by its flag, then to run with those settings to resume ``source`` or ``afresh``; else one line
    for each ``noted`` setting that differs. No record: nothing to say."""
    saved = read_record(path, afresh)
    if saved is None:
        return []
    defining, noted = _as_kept(defining), _as_kept(noted or {})  # compared as they read back (a tuple as a list)
    # a setting older code only noted (--clock) is checked against the value the record noted of it
    was = {**_section(saved, "noted"), **_section(saved, "defining")}
    differences = [f"{key} {said(was[key])}, not {said(value)}" for key, value in defining.items()
                   if key in was and was[key] != value]
    if differences:
        raise RunRecordError(f"cannot resume from {source}: it was made with {'; '.join(differences)}; run with "
                             f"those settings to resume it, or {afresh}")
    ran = _section(saved, "noted")
    return [f"resuming {source} with {key} {said(value)}; its last session went with {key} {said(ran[key])}"
            for key, value in noted.items() if key in ran and ran[key] != value]


def recorded_seconds(path: Path) -> float:
    """The seconds the processes before this one ran, as the record at ``path`` keeps them (0: none kept)."""
    try:
        seconds = (read_record(path, afresh="") or {}).get("seconds", 0.0)
    except RunRecordError:  # a damaged record is said where the resume is checked
        return 0.0
    return float(seconds) if isinstance(seconds, (int, float)) and seconds >= 0 else 0.0


def said(value) -> str:
    """A recorded setting as a user gives it (None, or an empty table of options: not given)."""
    if value is None or value == {}:
        return "(not given)"
    return value if isinstance(value, str) else json.dumps(value)


def _section(saved: dict, key: str) -> dict:
    return saved[key] if isinstance(saved.get(key), dict) else {}


def _as_kept(settings: dict) -> dict:
    """``settings`` as the record keeps them (JSON: a tuple reads back as a list, a path as a string)."""
    return json.loads(json.dumps(settings, default=str))
