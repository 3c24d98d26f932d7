"""Per-round (or per-step) scalars as a CSV table and as TensorBoard events, beside a run's metrics.jsonl."""

from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from fedpar.protocol.atomicfile import atomic_path, atomic_write_bytes

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


class AppendedCsv:
    """A CSV table that gains one row at a time, appended as a line. Its columns are declared up front (plus the
    first row's keys), so in steady state a row brings no new column; one that does widens the table once: the
    table is rewritten (atomically) streaming every row from ``source`` (rows are never held in memory), so a run
    rewrites it at most once per distinct column name, however long it runs."""

    def __init__(self, path: Path, declared: Sequence[str], source: Callable[[], Iterable[dict]]):
        self.path = Path(path)
        self.declared = list(declared)
        self.source = source  # the same rows, every one written so far (a run's metrics.jsonl, read line by line)
        self.columns: list[str] | None = None  # as the file on disk has them (None: not written by us yet)
        self.rewrites = 0

    def append(self, row: dict) -> None:
        """Add ``row`` (already in ``source``) as the table's last line."""
        if self.columns is None or not self.path.exists():
            self.columns = csv_columns([row, dict.fromkeys(self.declared)])
            atomic_write_bytes(self.path, [csv_bytes([row], self.columns)])
        elif set(row) <= set(self.columns):
            try:
                with self.path.open("ab") as fh:
                    fh.write(csv_bytes([row], self.columns, header=False))
            except OSError as exc:  # a full disk says no file name when the write fails: name the one it was for
                raise OSError(exc.errno, exc.strerror, exc.filename or str(self.path)) from exc
        else:
            self.rewrite(csv_columns([dict.fromkeys(self.columns), row]))

    def rewrite(self, columns: list[str] | None = None) -> None:
        """Write the whole table anew from ``source`` (``columns``; default: the declared ones and every key of
        ``source``, found by a first pass), streaming."""
        if columns is None:
            columns = csv_columns([dict.fromkeys(self.columns or []), *self.source(),
                                   dict.fromkeys(self.declared)])
        self.columns = columns
        self.rewrites += 1
        with atomic_path(self.path) as tmp, open(tmp, "wb") as fh:
            fh.write(csv_bytes([], columns))
            for row in self.source():
                fh.write(csv_bytes([row], columns, header=False))

    def settle(self, last_round: int, rows_after: Callable[[int], list[dict] | None]) -> None:
        """After a restart: make the table hold exactly the rows of ``source`` up to ``last_round`` (a ``round``
        column first). Its lines of later rounds and a torn last line are cut off in place, reading from the end;
        rows it lacks come from ``rows_after(its last round)`` (None: too many, and the table is rewritten)."""
        header = _first_line(self.path)
        if header is None or not header.endswith(b"\n"):
            self.rewrite()
            return
        self.columns = next(csv.reader([header.decode(errors="replace")]))
        if not self.columns or self.columns[0] != "round":
            self.rewrite()
            return
        kept_round, cut = 0, len(header)
        for offset, line in lines_backward(self.path):
            if offset < len(header):
                break
            round_id = _leading_int(line)
            if line.endswith(b"\n") and round_id is not None and round_id <= last_round:
                kept_round, cut = round_id, offset + len(line)
                break
        truncate(self.path, cut)
        if kept_round < last_round:
            missing = rows_after(kept_round)
            if missing is None or any(not set(row) <= set(self.columns) for row in missing):
                self.rewrite()
                return
            with self.path.open("ab") as fh:
                fh.write(csv_bytes(missing, self.columns, header=False))


def lines_backward(path: Path, block: int = 1 << 16) -> Iterator[tuple[int, bytes]]:
    """``(offset, line)`` of each line of ``path``, from the last to the first, read in blocks from the end (a last
    line without its newline comes as it is); memory: one block and one line."""
    with open(path, "rb") as fh:
        pos = fh.seek(0, os.SEEK_END)
        buf, stop = b"", 0  # buf holds the file from pos on; buf[:stop] is not yielded yet
        while True:
            newline = buf.rfind(b"\n", 0, stop - 1) if stop > 1 else -1
            if newline >= 0 or (pos == 0 and stop > 0):
                start = newline + 1
                yield pos + start, buf[start:stop]
                stop = start
                continue
            if pos == 0:
                return
            step = min(block, pos)
            pos -= step
            fh.seek(pos)
            buf = fh.read(step) + buf[:stop]
            stop += step


def truncate(path: Path, size: int) -> None:
    """Cut ``path`` to its first ``size`` bytes, durably (a no-op when it is that long already)."""
    with open(path, "r+b") as fh:
        if fh.seek(0, os.SEEK_END) != size:
            fh.truncate(size)
            os.fsync(fh.fileno())


def _first_line(path: Path, limit: int = 1 << 20) -> bytes | None:
    """The first line of ``path`` with its newline (at most ``limit`` bytes), or None when there is no file."""
    try:
        with open(path, "rb") as fh:
            return fh.readline(limit) or None
    except FileNotFoundError:
        return None


def _leading_int(line: bytes) -> int | None:
    """The integer before the first comma of a CSV line (its round), or None."""
    head = line.split(b",", 1)[0].strip()
    return int(head) if head.isdigit() else None


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
