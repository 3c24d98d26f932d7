"""A run's logs of its rows: one row per completed round (or step), appended to metrics.jsonl and to the CSV table
beside it (metrics.csv), the running summary of those rows (summary.json's figures), and the same scalars as
TensorBoard events.

Rows go to disk only: in memory the coordinator's log keeps the running summary, the last row and the first row this
process logged, so its memory does not grow with the rounds. A restart reads the checkpoint's row and summary, and
repairs the files' ends in place (reading from the end), never the whole history.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from fedpar.protocol.atomicfile import atomic_path, atomic_write_bytes

TAIL_ROWS = 64  # rows metrics.csv may lack after a crash before its lines are copied from the end of metrics.jsonl
# what the summary reads from the last row (training_error: why its members' own code failed their tasks)
_LAST_KEYS = ("test_accuracy", "dp_epsilon", "sim_seconds", "training_error", "refused_because")
TENSORBOARD_HINT = "--tensorboard needs the tensorboard package: pip install 'fedpar[tensorboard]'"


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return clean_row(value)
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def clean_row(row: dict) -> dict:
    """``row`` with non-finite floats replaced by None, in nested dicts and lists too (strict JSON)."""
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


def another_runs_rows(path: Path, last_round: int, last_row: dict | None) -> str:
    """Why the metrics.jsonl ``path`` holds another run's rows than the run checkpointed after ``last_round`` with its
    row ``last_row`` (its row of that round, read from the end, is not that one: another run wrote into the folder
    since), or "" (also when it cannot tell: no row kept, no file, or a file without that round's row, as a crash
    before the row's line leaves it)."""
    if last_row is None or not Path(path).is_file():
        return ""
    for _, line in lines_backward(Path(path)):
        row = _parse(line)
        if row is not None and row["round"] <= last_round:
            if row["round"] == last_round and row != json.loads(json.dumps(clean_row(last_row))):
                return f"its round {last_round} is not the one the checkpoint was made after"
            return ""
    return ""


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

    def resume(self, last_round: int, last_row: dict | None, summary: dict | None,
               earlier: str | None = None) -> bool:
        """Continue after the checkpoint of ``last_round``, whose row and running summary it holds (a checkpoint from
        before summaries were kept: None, and the summary is counted once from the file, streaming).

        The files end up holding exactly one row per round up to ``last_round``: rows of a round that was in flight
        at a crash (and will run again) and a torn last line are cut off in place, reading from the end, and the
        checkpointed round's row is appended if the crash came before its line. ``earlier``: the metrics.jsonl the
        run wrote before (:attr:`path` as the checkpoint recorded it); resumed into another folder whose file holds
        no rows yet, this one starts with that file's rows up to ``last_round``. False when it should have and the
        file is gone or holds another run's rows now (this one's rows then start at the checkpointed round).
        """
        found = self._take_earlier_rows(Path(earlier), last_round, last_row) if self.path and earlier else True
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
        return found

    def _take_earlier_rows(self, earlier: Path, last_round: int, last_row: dict | None) -> bool:
        """Copy ``earlier``'s rows up to ``last_round`` into this log when it is another file and this one holds
        none (streaming); False when they were to be taken and ``earlier`` is gone, or holds another run's rows now
        (:func:`another_runs_rows`: a run into that folder since)."""
        if earlier.resolve() == self.path.resolve() or (self.path.exists() and self.path.stat().st_size):
            return True
        if not earlier.is_file() or another_runs_rows(earlier, last_round, last_row):
            return False
        with self.path.open("w") as fh:
            for row in read_rows(earlier):
                if row["round"] <= last_round:
                    fh.write(json.dumps(row) + "\n")
        return True

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


@dataclass
class RunningSummary:
    """Accuracy, rounds and failed rounds, mean round seconds and upload bytes, the privacy budget spent, simulated
    seconds under a virtual clock, why the last round's members' own code failed their tasks, and the time to
    ``target_accuracy`` if given, from the rows taken so far."""

    target_accuracy: float | None = None
    rounds: int = 0
    failed_rounds: int = 0
    round_seconds_sum: float = 0  # summed in row order from 0, as sum() does: the means come out the same
    upload_bytes_sum: float = 0
    best_test_accuracy: float | None = None
    last: dict = field(default_factory=dict)  # the last row's entries of _LAST_KEYS that it has
    hit: dict | None = None  # round, wall_seconds (and sim_seconds) of the first row at the target accuracy

    def add(self, row: dict) -> None:
        """Take the next round's (cleaned) metrics row."""
        accuracy = row.get("test_accuracy")  # None: nothing was evaluated (a Flower App's ServerApp, no test set)
        self.rounds += 1
        self.failed_rounds += row.get("status") != "ok"
        self.round_seconds_sum = self.round_seconds_sum + (row.get("round_seconds") or 0)  # a row without: 0
        self.upload_bytes_sum = self.upload_bytes_sum + (row.get("upload_bytes") or 0)
        if accuracy is not None and (self.best_test_accuracy is None or accuracy > self.best_test_accuracy):
            self.best_test_accuracy = accuracy
        self.last = {k: row[k] for k in _LAST_KEYS if k in row}
        if self.hit is None and self.target_accuracy is not None and accuracy is not None \
                and accuracy >= self.target_accuracy:
            self.hit = {"round": row.get("round"), "wall_seconds": row.get("wall_seconds"),
                        "sim_seconds": row.get("sim_seconds")}

    def result(self) -> dict:
        """summary.json's figures (``simulate``'s and ``serve``'s), in its order."""
        n = self.rounds
        out = {"final_test_accuracy": self.last.get("test_accuracy") if n else None,
               "best_test_accuracy": self.best_test_accuracy,
               "rounds": n,
               "failed_rounds": self.failed_rounds,
               "mean_round_seconds": self.round_seconds_sum / n if n else None,
               "mean_upload_bytes_per_round": self.upload_bytes_sum / n if n else None}
        if "dp_epsilon" in self.last:
            out["final_dp_epsilon"] = self.last["dp_epsilon"]
        if "sim_seconds" in self.last:
            out["sim_seconds"] = self.last["sim_seconds"]
        if "training_error" in self.last:
            out["training_error"] = self.last["training_error"]
        if "refused_because" in self.last:  # the last round's every update was refused, e.g. for NaN
            out["refused_because"] = self.last["refused_because"]
        if self.target_accuracy is not None:
            hit = self.hit
            out.update(target_accuracy=self.target_accuracy, rounds_to_target=hit["round"] if hit else None,
                       wall_seconds_to_target=hit["wall_seconds"] if hit else None)
            if "sim_seconds" in self.last:
                out["sim_seconds_to_target"] = hit["sim_seconds"] if hit else None
        return out

    def copy(self) -> RunningSummary:
        """An independent copy (to count a row for a checkpoint before the log takes it)."""
        return RunningSummary(**{**asdict(self), "last": dict(self.last),
                                 "hit": dict(self.hit) if self.hit else None})

    def state(self) -> dict:
        """JSON-able state (a checkpoint's ``metrics_summary``)."""
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> RunningSummary:
        """The summary :meth:`state` saved; ValueError when it is not one."""
        if not isinstance(state, dict) or set(state) != {f.name for f in fields(cls)}:
            raise ValueError(f"not a running summary: {state!r:.200}")
        numbers = [state[k] for k in ("rounds", "failed_rounds", "round_seconds_sum", "upload_bytes_sum")]
        optional = [state[k] for k in ("target_accuracy", "best_test_accuracy")]
        if not all(_number(v) for v in numbers) or not all(v is None or _number(v) for v in optional) \
                or not isinstance(state["rounds"], int) or not isinstance(state["failed_rounds"], int) \
                or not isinstance(state["last"], dict) or set(state["last"]) - set(_LAST_KEYS) \
                or not (state["hit"] is None or isinstance(state["hit"], dict)):
            raise ValueError(f"not a running summary: {state!r:.200}")
        return cls(**state)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
        """Add ``row`` (already in ``source``) as the table's last line; the first row starts the table, header
        first, written like any later line (a crash that tears it is repaired as theirs is: :meth:`settle`)."""
        if self.columns is None or not self.path.exists():
            self.columns = csv_columns([row, dict.fromkeys(self.declared)])
            self._write("wb", csv_bytes([row], self.columns))
        elif set(row) <= set(self.columns):
            self._write("ab", csv_bytes([row], self.columns, header=False))
        else:
            self.rewrite(csv_columns([dict.fromkeys(self.columns), row]))

    def _write(self, mode: str, data: bytes) -> None:
        try:
            with self.path.open(mode) as fh:
                fh.write(data)
        except OSError as exc:  # a full disk says no file name when the write fails: name the one it was for
            raise OSError(exc.errno, exc.strerror, exc.filename or str(self.path)) from exc

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
    """Writes the numeric entries of each row as TensorBoard scalars at the row's step (round or step).

    ``purge_step``: a resumed run's first step; TensorBoard drops the events an interrupted run wrote in this folder
    from that step on (those steps run again), as metrics.jsonl drops their lines."""

    def __init__(self, log_dir: str | Path, step_key: str = "round", prefix: str = "", purge_step: int | None = None):
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        self.step_key = step_key
        self.prefix = prefix
        self._at: tuple[int, set[str]] = (-1, set())  # the last step written and its tags

    def resume(self, row: dict | None) -> None:
        """A run resumed after the round of ``row`` (its metrics row, which a resume may have repaired; None: a run
        that starts afresh): the events an interrupted run wrote from that round on are dropped (as purge_step drops
        them) and the row is written again, so the round has its one point, also where the interrupted run died
        before writing it."""
        if row is None:
            return
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        step = int(row.get(self.step_key, 0))
        self.writer.file_writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))
        self.write(row)

    def write(self, row: dict) -> None:
        """One row's finite numbers (booleans and text are skipped), flushed so a running TensorBoard sees them. A tag
        the step's earlier row wrote already is left out (train's evaluation of a logged step repeats its epoch):
        one point per tag and step."""
        step = int(row.get(self.step_key, 0))
        if step != self._at[0]:
            self._at = (step, set())
        written = self._at[1]
        for key, value in row.items():
            if key == self.step_key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value) and key not in written:
                self.writer.add_scalar(f"{self.prefix}{key}", value, step)
                written.add(key)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()
