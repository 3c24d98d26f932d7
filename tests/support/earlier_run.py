"""An earlier run's outputs in an --out folder, for the tests of a new run into it (simulations/run_outputs.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

EARLIER = ("metrics.jsonl", "metrics.csv", "global.safetensors", "global.json", "summary.json", "labels.png")


def earlier_run(out: Path) -> dict[str, str]:
    """An earlier run's files made in ``out`` (made too); their digests by name."""
    out.mkdir()
    for name in EARLIER:
        (out / name).write_text(f"{name} of an earlier run\n")
    return file_digests(out)


def file_digests(folder: Path) -> dict[str, str]:
    """The files in ``folder``: their SHA-256 digests by name."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}
