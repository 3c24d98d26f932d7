"""examples/own_task.py's reference and a CSV table for it (the own-task tutorial's, as tests run it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "own_task.py") + ":task"


def write_table(path: Path, rows: int = 300, seed: int = 0) -> Path:
    """A CSV of 4 numeric features and a 3-class label that depends on them."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4))
    y = (x[:, 0] + x[:, 1] > 0).astype(int) + (x[:, 2] > 0.8)
    lines = ["f0,f1,f2,f3,label"] + [",".join(f"{v:.4f}" for v in r) + f",{int(c)}" for r, c in zip(x, y)]
    path.write_text("\n".join(lines) + "\n")
    return path
