"""Per-round metrics as JSON lines, and the same rows as CSV beside them (metrics.csv)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from fedpar.protocol.atomicfile import atomic_write_bytes
from fedpar.protocol.run_logs import GrowingCsv


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def clean_row(row: dict) -> dict:
    """``row`` with non-finite floats replaced by None (strict JSON)."""
    return {k: _clean(v) for k, v in row.items()}


def time_to_accuracy(rows: list[dict], target: float) -> dict:
    """Rounds, wall seconds and (under a virtual clock) simulated seconds until the central test accuracy first
    reached ``target`` (None each when it never did)."""
    hit = next((r for r in rows if (r.get("test_accuracy") or 0.0) >= target), None)
    out = {"target_accuracy": target, "rounds_to_target": hit["round"] if hit else None,
           "wall_seconds_to_target": hit["wall_seconds"] if hit else None}
    if rows and "sim_seconds" in rows[-1]:
        out["sim_seconds_to_target"] = hit["sim_seconds"] if hit else None
    return out


def summarize_rounds(rows: list[dict], target_accuracy: float | None = None) -> dict:
    """What a run's rounds came to: accuracy, rounds and failed rounds, mean round seconds and upload bytes, the
    privacy budget spent, simulated seconds under a virtual clock, and the time to ``target_accuracy`` if given
    (``simulate``'s and ``serve``'s summary.json)."""
    summary = {
        "final_test_accuracy": rows[-1].get("test_accuracy") if rows else None,
        "best_test_accuracy": max((r.get("test_accuracy") or 0.0 for r in rows), default=None),
        "rounds": len(rows),
        "failed_rounds": sum(r["status"] != "ok" for r in rows),
        "mean_round_seconds": sum(r["round_seconds"] for r in rows) / len(rows) if rows else None,
        "mean_upload_bytes_per_round": sum(r["upload_bytes"] for r in rows) / len(rows) if rows else None,
    }
    if rows and "dp_epsilon" in rows[-1]:
        summary["final_dp_epsilon"] = rows[-1]["dp_epsilon"]
    if rows and "sim_seconds" in rows[-1]:
        summary["sim_seconds"] = rows[-1]["sim_seconds"]
    if target_accuracy is not None:
        summary.update(time_to_accuracy(rows, target_accuracy))
    return summary


class RoundMetricsLog:
    """The coordinator's metrics.jsonl: one JSON object per completed round, appended (and kept in memory); its
    rows are also written as metrics.csv (a row appended; the table rewritten when a row brings a new column)."""

    def __init__(self, path: Path | None):
        self.path = Path(path) if path else None
        self.rows: list[dict] = []
        self._csv = GrowingCsv(self.csv_path) if self.path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, row: dict) -> None:
        """Record one round's metrics."""
        row = clean_row(row)
        self.rows.append(row)
        if self.path:
            with self.path.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            self._csv.write(self.rows)

    @property
    def csv_path(self) -> Path | None:
        """metrics.csv beside metrics.jsonl."""
        return self.path.with_suffix(".csv") if self.path else None

    def resume(self, last_round: int, last_row: dict | None) -> None:
        """Make the file hold exactly one row per round up to ``last_round`` (the checkpointed one).

        Rows of a round that was in flight at a crash (and will run again) are dropped, a torn last line
        is discarded, and the checkpointed round's row is appended if the crash came before its line.
        """
        lines = self.path.read_text(errors="replace").splitlines() if self.path and self.path.exists() else []
        rows: dict[int, dict] = {}
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by the crash
            if isinstance(row, dict) and isinstance(row.get("round"), int) and row["round"] <= last_round:
                rows.setdefault(row["round"], row)
        if last_row is not None and last_round not in rows:
            rows[last_round] = last_row
        self.rows = [rows[r] for r in sorted(rows)]
        if self.path:
            self._rewrite()

    def _rewrite(self) -> None:
        atomic_write_bytes(self.path, [(json.dumps(row) + "\n").encode() for row in self.rows])
        self._csv.rewrite(self.rows)
