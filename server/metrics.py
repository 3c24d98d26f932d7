"""Per-round metrics as JSON lines, and the same rows as CSV beside them (metrics.csv).

Rows go to disk only: in memory the log keeps the running summary (summary.json's figures), the last row and the
first row this process logged, so its memory does not grow with the rounds. A restart reads the checkpoint's row
and summary, and repairs the files' ends in place (reading from the end), never the whole history.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator, Sequence

from fedpar.protocol.run_logs import AppendedCsv, lines_backward, truncate
from fedpar.server.run_summary import RunningSummary

TAIL_ROWS = 64  # rows metrics.csv may lack after a crash before its lines are copied from the end of metrics.jsonl


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def clean_row(row: dict) -> dict:
    """``row`` with non-finite floats replaced by None (strict JSON)."""
    return {k: _clean(v) for k, v in row.items()}


def read_rows(path: Path) -> Iterator[dict]:
    """The rows of a metrics.jsonl, read line by line (a line torn by a crash is skipped)."""
    with open(path, "rb") as fh:
        for line in fh:
            row = _parse(line)
            if row is not None:
                yield row


def _parse(line: bytes) -> dict | None:
    """A complete line's row (a dict with an integer round), or None."""
    if not line.endswith(b"\n"):
        return None
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return row if isinstance(row, dict) and isinstance(row.get("round"), int) else None


class RoundMetricsLog:
    """The coordinator's metrics.jsonl: one JSON object per completed round, appended; its rows are also appended to
    metrics.csv, whose columns are ``declared`` up front (server/coordinator.py: what the configuration's rows hold)
    so steady state never rewrites it. ``path`` None: nothing is written, the summary is still kept."""

    def __init__(self, path: Path | None, declared: Sequence[str] = (), target_accuracy: float | None = None):
        self.path = Path(path) if path else None
        self.summary = RunningSummary(target_accuracy)
        self.last: dict | None = None  # the last completed round's row (after a restart: the checkpointed one's)
        self.first: dict | None = None  # the first row this process logged
        self._csv = AppendedCsv(self.csv_path, declared, self.read_rows) if self.path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    @property
    def csv_path(self) -> Path | None:
        """metrics.csv beside metrics.jsonl."""
        return self.path.with_suffix(".csv") if self.path else None

    def append(self, row: dict) -> None:
        """Record one round's metrics."""
        row = clean_row(row)
        self.summary.add(row)
        self.last = row
        if self.first is None:
            self.first = row
        if self.path:
            try:
                with self.path.open("a") as fh:
                    fh.write(json.dumps(row) + "\n")
            except OSError as exc:  # a full disk says no file name when the write fails: name the one it was for
                raise OSError(exc.errno, exc.strerror, exc.filename or str(self.path)) from exc
            self._csv.append(row)

    def summary_with(self, row: dict) -> dict:
        """The summary's state once ``row`` is counted too (for the checkpoint written before the row is logged)."""
        ahead = self.summary.copy()
        ahead.add(clean_row(row))
        return ahead.state()

    def read_rows(self) -> Iterator[dict]:
        """Every row logged so far (also before a restart), streamed from metrics.jsonl."""
        if self.path is None:
            raise ValueError("this coordinator writes no metrics.jsonl (no metrics_path): its rows are not kept")
        return read_rows(self.path) if self.path.exists() else iter(())

    def resume(self, last_round: int, last_row: dict | None, summary: dict | None) -> None:
        """Continue after the checkpoint of ``last_round``, whose row and running summary it holds (a checkpoint from
        before summaries were kept: None, and the summary is counted once from the file, streaming).

        The files end up holding exactly one row per round up to ``last_round``: rows of a round that was in flight
        at a crash (and will run again) and a torn last line are cut off in place, reading from the end, and the
        checkpointed round's row is appended if the crash came before its line.
        """
        kept = self._settle_jsonl(last_round) if self.path else None
        if last_row is not None and (kept is None or kept["round"] < last_round):
            kept = clean_row(last_row)
            if self.path:
                with self.path.open("a") as fh:
                    fh.write(json.dumps(kept) + "\n")
        self.last = kept
        target = self.summary.target_accuracy
        if summary is not None and summary.get("target_accuracy") == target:
            self.summary = RunningSummary.from_state(summary)
        else:
            self.summary = RunningSummary(target)
            rows = self.read_rows() if self.path else ([kept] if kept else [])
            for row in rows:
                self.summary.add(row)
        if self.path:
            self._csv.settle(last_round, self._rows_after)

    def _settle_jsonl(self, last_round: int) -> dict | None:
        """Cut metrics.jsonl after its last complete row of a round <= ``last_round``; that row (None: none)."""
        if not self.path.exists():
            return None
        cut, kept = 0, None
        for offset, line in lines_backward(self.path):
            row = _parse(line)
            if row is not None and row["round"] <= last_round:
                cut, kept = offset + len(line), row
                break
        truncate(self.path, cut)
        return kept

    def _rows_after(self, round_id: int) -> list[dict] | None:
        """The rows of metrics.jsonl after ``round_id``, read from its end (None: more than TAIL_ROWS of them)."""
        rows: list[dict] = []
        for _, line in lines_backward(self.path):
            row = _parse(line)
            if row is None:
                continue
            if row["round"] <= round_id:
                break
            if len(rows) == TAIL_ROWS:
                return None
            rows.append(row)
        return rows[::-1]
