"""Per-round metrics as JSON lines."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    """Appends one JSON object per round to a file (and keeps them in memory)."""

    def __init__(self, path: Path | None):
        self.path = Path(path) if path else None
        self.rows: list[dict] = []
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, row: dict) -> None:
        """Record one round's metrics."""
        row = {k: _clean(v) for k, v in row.items()}
        self.rows.append(row)
        if self.path:
            with self.path.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
