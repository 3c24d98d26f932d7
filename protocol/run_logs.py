"""Per-round (or per-step) scalars as a CSV table and as TensorBoard events, beside a run's metrics.jsonl."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Iterable

from fedpar.protocol.atomicfile import atomic_write_bytes

TENSORBOARD_HINT = "--tensorboard needs the tensorboard package: pip install 'fedpar[tensorboard]'"


def csv_columns(rows: Iterable[dict]) -> list[str]:
    """One column per key seen in any of ``rows``, in order of first appearance."""
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    return list(columns)


def csv_bytes(rows: Iterable[dict], columns: list[str] | None = None, header: bool = True) -> bytes:
    """``rows`` as CSV: ``columns`` (default :func:`csv_columns`), blanks where a row has none."""
    rows = list(rows)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=csv_columns(rows) if columns is None else columns, restval="",
                            lineterminator="\n")
    if header:
        writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return out.getvalue().encode()


def write_csv(path: Path, rows: Iterable[dict]) -> None:
    """Write ``rows`` to ``path`` as CSV, atomically (a reader never sees half a table)."""
    atomic_write_bytes(path, [csv_bytes(rows)])


class GrowingCsv:
    """A CSV table that gains one row at a time: a row within the table's columns is appended as a line; one with a
    new column rewrites the table (atomically), so a long run does not rewrite every row every round."""

    def __init__(self, path: Path):
        self.path = path
        self.columns: list[str] | None = None  # as the file on disk has them (None: not written by us yet)

    def write(self, rows: list[dict]) -> None:
        """Bring the file up to ``rows``, of which only the last one is new since the previous call."""
        if rows and self.columns is not None and set(rows[-1]) <= set(self.columns) and self.path.exists():
            with self.path.open("ab") as fh:
                fh.write(csv_bytes(rows[-1:], self.columns, header=False))
            return
        self.rewrite(rows)

    def rewrite(self, rows: list[dict]) -> None:
        """Write the whole table anew."""
        self.columns = csv_columns(rows)
        atomic_write_bytes(self.path, [csv_bytes(rows, self.columns)])


def check_tensorboard() -> None:
    """RuntimeError saying how to install tensorboard unless torch can write TensorBoard events here."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise RuntimeError(TENSORBOARD_HINT) from None


class TensorBoardScalars:
    """Writes the numeric entries of each row as TensorBoard scalars at the row's step (round or step)."""

    def __init__(self, log_dir: str | Path, step_key: str = "round", prefix: str = ""):
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.step_key = step_key
        self.prefix = prefix

    def write(self, row: dict) -> None:
        """One row's finite numbers (booleans and text are skipped), flushed so a running TensorBoard sees them."""
        step = int(row.get(self.step_key, 0))
        for key, value in row.items():
            if key == self.step_key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                self.writer.add_scalar(f"{self.prefix}{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()
