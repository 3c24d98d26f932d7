"""summary.json and the round plots of a federated run, written one way for `fedpar simulate` and `fedpar serve`."""

from __future__ import annotations

import json
from pathlib import Path

from fedpar.protocol.atomicfile import atomic_write_bytes
from fedpar.server.metrics import RoundMetricsLog


def write_run_outputs(out: Path, metrics: RoundMetricsLog, extra: dict, title: str) -> dict:
    """OUT/summary.json (what the rounds came to, from the log's running summary, with the time to its target
    accuracy if it has one, then ``extra``) and, when a round completed, OUT/accuracy.png and OUT/loss.png from its
    metrics.jsonl (streamed); returns the summary. A run stopped by Ctrl-C (``extra["interrupted"]``) gets no plots:
    rendering them takes about a second on a busy machine, and Ctrl-C must stop a run within 2 s."""
    out = Path(out)
    summary = {**metrics.summary.result(), **extra}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "summary.json", [(json.dumps(summary, indent=2) + "\n").encode()])
    if metrics.summary.rounds and metrics.path is not None and not extra.get("interrupted"):
        from fedpar.simulations.plots import plot_rounds  # matplotlib: about a second to import

        plot_rounds(metrics.read_rows(), out, title)
    return summary
