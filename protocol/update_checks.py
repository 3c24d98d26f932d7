"""The checks one update's report must pass wherever it is checked: by the coordinator's intake (server/uploads.py)
and, before it sums its members' updates into one partial, by a population host (client/host_uploads.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping

MAX_CLIENT_METRICS = 64


def check_report(num_examples: int, registered: int, local_epochs: int, steps: int,
                 metrics: Mapping[str, float]) -> None:
    """A ValueError saying what is wrong with an update's weight (``num_examples``: 1..``registered`` x
    ``local_epochs``), ``steps`` or ``metrics`` (at most MAX_CLIENT_METRICS finite values, names <= 64 characters)."""
    max_examples = registered * local_epochs
    if not 1 <= num_examples <= max_examples:
        raise ValueError(f"num_examples={num_examples} must be in 1..{max_examples} "
                         f"({registered} registered examples x {local_epochs} epochs)")
    if steps < 0:
        raise ValueError("steps must be >= 0")
    if len(metrics) > MAX_CLIENT_METRICS or not all(math.isfinite(v) and len(k) <= 64 for k, v in metrics.items()):
        raise ValueError(f"metrics: at most {MAX_CLIENT_METRICS} finite values with names <= 64 characters")
