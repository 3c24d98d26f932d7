"""Per-round (or per-step) scalars as a CSV table and as TensorBoard events, beside a run's metrics.jsonl."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Iterable

from fedpar.protocol.atomicfile import atomic_write_bytes

TENSORBOARD_HINT = "--tensorboard needs the tensorboard package: pip install 'fedpar[tensorboard]'"


def csv_bytes(rows: Iterable[dict]) -> bytes:
    """``rows`` as CSV: one column per key seen in any row (in order of first appearance), blanks where absent."""
    rows = list(rows)
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(columns), restval="", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return out.getvalue().encode()


def write_csv(path: Path, rows: Iterable[dict]) -> None:
    """Write ``rows`` to ``path`` as CSV, atomically (a reader never sees half a table)."""
    atomic_write_bytes(path, [csv_bytes(rows)])


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
