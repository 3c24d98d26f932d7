"""summary.json and the round plots of a federated run, written one way for `fedpar simulate` and `fedpar serve`."""

from __future__ import annotations

import json
from pathlib import Path

from fedpar.protocol.atomicfile import atomic_write_bytes
from fedpar.server.metrics import summarize_rounds


def write_run_outputs(out: Path, rows: list[dict], extra: dict, title: str,
                      target_accuracy: float | None = None) -> dict:
    """OUT/summary.json (what the rounds came to, with the time to ``target_accuracy`` if given, then ``extra``)
    and, when a round completed, OUT/accuracy.png and OUT/loss.png; returns the summary. A run stopped by Ctrl-C (``extra["interrupted"]``) gets no plots: rendering
    them takes about a second on a busy machine, and Ctrl-C must stop a run within 2 s."""
    out = Path(out)
    summary = {**summarize_rounds(rows, target_accuracy), **extra}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "summary.json", [(json.dumps(summary, indent=2) + "\n").encode()])
    if rows and not extra.get("interrupted"):
        from fedpar.simulations.plots import plot_rounds  # matplotlib: about a second to import

        plot_rounds(rows, out, title)
    return summary
