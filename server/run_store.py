"""The run store of a long-lived coordinator service: runs, their per-round metrics, their log lines and the audit of
control actions, in SQLite.

One file (WAL mode, so readers never block the writer) or, for the one-shot form, memory. Every write is one
transaction: a kill -9 at any moment leaves the last committed state. The schema is versioned; :data:`MIGRATIONS`
brings an older file up to date on open. A state file is marked as fedpar's (PRAGMA application_id); another
application's SQLite database is refused before anything is written into it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATUSES = ("queued", "running", "finished", "failed", "stopped")
ENDED = ("finished", "failed", "stopped")
CANNOT_RESUME = "cannot resume: "  # a failed run whose reason starts so is queued again at the next start (retry)
TRIED_AGAIN = "the service tries again when it is started again on the same --state"

# Migration i brings a store of schema version i to version i + 1.
MIGRATIONS = (
    """
    CREATE TABLE runs (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        name TEXT NOT NULL,
        settings TEXT NOT NULL,
        status TEXT NOT NULL CHECK (status IN ('queued', 'running', 'finished', 'failed', 'stopped')),
        round INTEGER NOT NULL DEFAULT 0,
        last_metrics TEXT NOT NULL DEFAULT '{}',
        out_dir TEXT NOT NULL DEFAULT '',
        model_path TEXT NOT NULL DEFAULT '',
        reason TEXT NOT NULL DEFAULT '',
        stop_requested INTEGER NOT NULL DEFAULT 0,
        created REAL NOT NULL,
        started REAL,
        ended REAL
    );
    CREATE TABLE round_metrics (
        run_id INTEGER NOT NULL REFERENCES runs(id),
        round INTEGER NOT NULL,
        metrics TEXT NOT NULL,
        PRIMARY KEY (run_id, round)
    );
    """,
    """
    CREATE TABLE audit (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        at REAL NOT NULL,
        who TEXT NOT NULL,
        action TEXT NOT NULL,
        run_id INTEGER,
        detail TEXT NOT NULL DEFAULT ''
    );
    """,
    """
    CREATE TABLE run_log (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        run_id INTEGER NOT NULL REFERENCES runs(id),
        at REAL NOT NULL,
        line TEXT NOT NULL
    );
    ALTER TABLE round_metrics ADD COLUMN at REAL
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)
# PRAGMA application_id of fedpar's state files ("fedp"): another application's SQLite database is not written into
APPLICATION_ID = 0x66656470
# What a state file holds: a file made before APPLICATION_ID was set is known by these (and schema_version among them)
FEDPAR_TABLES = frozenset({"schema_version", "runs", "round_metrics", "audit", "run_log"})


class StoreError(RuntimeError):
    """The state file cannot be used (corrupt, locked, of a newer fedpar); the message says what to do."""


class MissingFolder(StoreError, FileNotFoundError):
    """The state file's folder is not there: a mistyped --state, which is refused rather than made. Also a
    FileNotFoundError, so that a command that meets it says it in one line and exits 2."""

    exit_code = 2


def check_state_folder(path: str | Path) -> None:
    """MissingFolder unless the folder state file ``path`` would be in exists (a file there is said too); StoreError
    when ``path`` is a folder, or a file SQLite keeps beside a state file."""
    folder = Path(path).absolute().parent
    if not folder.is_dir():
        what = "is a file, not a folder;" if folder.exists() else "does not exist; create it first, or"
        raise MissingFolder(f"the folder {folder} of state file {path} {what} give --state another path")
    if Path(path).is_dir():
        raise StoreError(_a_folder(path))
    _refuse_side_file(str(path))
    links = os.stat(path).st_nlink if os.path.isfile(path) else 1
    if links > 1:  # each name has its own lock and -wal: a second service under another name shared the database
        raise StoreError(f"state file {path} has {links} names (hard links): a service under each would keep a "
                         "write-ahead log of its own beside it and damage it; remove the other names, or give "
                         "--state a copy")


SIDE_FILES = {"-wal": "write-ahead log", "-shm": "shared memory index", "-journal": "rollback journal"}  # SQLite's


def _refuse_side_file(path: str) -> None:
    """StoreError when ``path`` is one of the files SQLite keeps beside a state file (a tab completion's slip): it was
    called a damaged state file to move aside, and a moved -wal takes the state file's latest writes with it."""
    for suffix, what in SIDE_FILES.items():
        state = path[:-len(suffix)]
        if path.endswith(suffix) and os.path.isfile(state):
            raise StoreError(f"{path} is the {what} SQLite keeps beside state file {state}, not a state file: give "
                             f"--state {state} (and leave {path} where it is: it may hold that file's latest writes)")


def _a_folder(path: str | Path) -> str:
    """The line for a state file ``path`` that is a folder."""
    return f"state file {path} is a folder; give --state the path of a file (e.g. {os.path.join(path, 'state.db')})"


class UnknownRun(KeyError):
    """No run has this id."""

    def __str__(self) -> str:
        return f"no run with id {self.args[0]}; 'fedpar run ls' lists them"


@dataclass
class Run:
    """One run as the store holds it."""

    id: int
    name: str
    settings: dict
    status: str
    round: int
    last_metrics: dict
    out_dir: str
    model_path: str
    reason: str
    stop_requested: bool
    created: float
    started: float | None
    ended: float | None

    def to_json(self) -> dict:
        """The run as a JSON-ready dict (what the control API sends)."""
        return dict(self.__dict__)


class RunStore:
    """Runs, round metrics and audit in SQLite at ``path`` (":memory:" for a store that dies with the process).
    Safe to use from several threads: one connection, one lock, one transaction per write."""

    def __init__(self, path: str | Path = ":memory:", busy_seconds: float = 5.0):
        self.path = str(path)
        # In memory (the one-shot form) only the last row is kept: metrics.jsonl holds the history, and memory must
        # not grow with the rounds of a run that lasts for months.
        self.keeps_rounds = self.path != ":memory:"
        self._lock = threading.Lock()
        if self.path != ":memory:":
            check_state_folder(self.path)  # sqlite would say only 'unable to open database file'
        try:
            self._db = sqlite3.connect(self.path, timeout=busy_seconds, check_same_thread=False,
                                       isolation_level=None)
        except sqlite3.DatabaseError as exc:
            raise StoreError(_explain(self.path, exc)) from None
        try:
            self._check_ours()  # before WAL mode, which rewrites the file's header
            if self.path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise StoreError(_explain(self.path, exc)) from None
        except StoreError:
            self._db.close()
            raise

    # ----------------------------------------------------------------- schema
    def _check_ours(self) -> None:
        """StoreError unless the database is fedpar's (marked with APPLICATION_ID, or made before the mark with
        fedpar's tables only) or holds no table yet: another application's is refused before anything is written."""
        mark = self._db.execute("PRAGMA application_id").fetchone()[0]
        tables = sorted(name for (name,) in self._db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"))
        if mark == APPLICATION_ID or (mark == 0 and not tables):
            return
        if mark == 0 and "schema_version" in tables and FEDPAR_TABLES.issuperset(tables):
            return
        shown = ", ".join(tables[:8]) + (f" and {len(tables) - 8} more" if len(tables) > 8 else "")
        raise StoreError(f"--state {self.path} is a SQLite database of another application (tables: "
                         f"{shown or 'none'}); give a new file or fedpar's own state file")

    def _migrate(self) -> None:
        with self._write() as db:
            db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = db.execute("SELECT version FROM schema_version").fetchone()
            version = row[0] if row else 0
            if version > SCHEMA_VERSION:
                raise StoreError(f"state file {self.path} has schema version {version}, newer than this fedpar's "
                                 f"{SCHEMA_VERSION}; upgrade fedpar")
            for step in MIGRATIONS[version:]:
                for statement in filter(str.strip, step.split(";")):
                    db.execute(statement)
            if row is None:
                db.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION,))
            else:
                db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))

    def schema_version(self) -> int:
        """The schema version of the open store."""
        return self._read("SELECT version FROM schema_version")[0][0]

    # ----------------------------------------------------------------- transactions
    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE), committed when the block ends and rolled back if it raises."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._roll_back()
                raise
            try:
                self._db.execute("COMMIT")
            except sqlite3.Error:
                self._roll_back()  # a failed COMMIT (a full disk) may leave the transaction open
                raise

    def _roll_back(self) -> None:
        # sqlite may have rolled back by itself (after an I/O error): then the error that got here is the one to say
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("ROLLBACK")

    def _read(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._lock:
            try:
                return self._db.execute(sql, params).fetchall()
            except sqlite3.DatabaseError as exc:
                raise StoreError(_explain(self.path, exc)) from None

    def _run_write(self, fn) -> Any:
        try:
            with self._write() as db:
                return fn(db)
        except sqlite3.DatabaseError as exc:
            raise StoreError(_explain(self.path, exc)) from None

    def close(self) -> None:
        """Close the database (every write is committed already)."""
        with self._lock:
            self._db.close()

    # ----------------------------------------------------------------- runs
    def submit(self, name: str, settings: dict, who: str = "local", reason: str = "") -> int:
        """Queue a run of ``settings`` (JSON-ready, already validated), ``reason`` saying what it waits for ('fedpar
        run ls' shows it); returns its id. Audited."""
        def write(db):
            run_id = db.execute("INSERT INTO runs (name, settings, status, reason, created) VALUES "
                                "(?, ?, 'queued', ?, ?)",
                                (name, json.dumps(settings, sort_keys=True), reason, time.time())).lastrowid
            _audit(db, who, "submit", run_id, name)
            return run_id
        return self._run_write(write)

    def get(self, run_id: int) -> Run:
        """The run ``run_id`` (UnknownRun if there is none)."""
        rows = self._read(f"SELECT {_COLUMNS} FROM runs WHERE id = ?", (int(run_id),))
        if not rows:
            raise UnknownRun(run_id)
        return _run(rows[0])

    def runs(self, after_id: int = 0) -> list[Run]:
        """Every run (those with ids above ``after_id``), oldest first."""
        return [_run(row) for row in self._read(f"SELECT {_COLUMNS} FROM runs WHERE id > ? ORDER BY id",
                                                (int(after_id),))]

    def next_queued(self) -> Run | None:
        """The oldest queued run, or None."""
        rows = self._read(f"SELECT {_COLUMNS} FROM runs WHERE status = 'queued' ORDER BY id LIMIT 1")
        return _run(rows[0]) if rows else None

    def fix_settings(self, run_id: int, settings: dict) -> None:
        """Replace the settings of ``run_id`` (JSON-ready): a run submitted with only its file's keys gets all."""
        self._run_write(lambda db: db.execute("UPDATE runs SET settings = ? WHERE id = ?",
                                              (json.dumps(settings, sort_keys=True), run_id)))

    def start(self, run_id: int, out_dir: str) -> None:
        """Mark ``run_id`` running, writing into ``out_dir``."""
        self._run_write(lambda db: db.execute(
            "UPDATE runs SET status = 'running', out_dir = ?, started = COALESCE(started, ?) WHERE id = ?",
            (out_dir, time.time(), run_id)))

    def record_round(self, run_id: int, row: dict) -> None:
        """Make round ``row["round"]``'s metrics the last of ``run_id`` and keep them among its rounds unless the store
        is in memory (one transaction)."""
        text = json.dumps(row, sort_keys=True, default=str)

        def write(db):
            if self.keeps_rounds:
                db.execute("INSERT OR REPLACE INTO round_metrics (run_id, round, metrics, at) VALUES (?, ?, ?, ?)",
                           (run_id, int(row["round"]), text, time.time()))
            db.execute("UPDATE runs SET round = ?, last_metrics = ? WHERE id = ?", (int(row["round"]), text, run_id))
        self._run_write(write)

    def round_metrics(self, run_id: int, after: int = 0) -> list[dict]:
        """The metrics rows of ``run_id`` after round ``after``, in order."""
        self.get(run_id)
        return [json.loads(text) for (text,) in self._read(
            "SELECT metrics FROM round_metrics WHERE run_id = ? AND round > ? ORDER BY round", (run_id, after))]

    def end(self, run_id: int, status: str, reason: str = "", model_path: str = "") -> None:
        """Mark ``run_id`` ended with ``status`` (finished, failed or stopped) and why."""
        if status not in ENDED:
            raise ValueError(f"a run ends finished, failed or stopped, not {status!r}")
        self._run_write(lambda db: db.execute(
            "UPDATE runs SET status = ?, reason = ?, model_path = ?, ended = ? WHERE id = ?",
            (status, reason, model_path, time.time(), run_id)))

    def request_stop(self, run_id: int, who: str = "local") -> Run:
        """Ask ``run_id`` to stop: a queued run is stopped at once, a running one at its next check, and a failed one
        that could not resume (tried again at each start) is stopped for good. Audited. The run as it was."""
        def write(db):
            row = db.execute(f"SELECT {_COLUMNS} FROM runs WHERE id = ?", (int(run_id),)).fetchone()
            if row is None:
                raise UnknownRun(run_id)
            run = _run(row)
            if run.status == "queued":
                db.execute("UPDATE runs SET status = 'stopped', reason = ?, ended = ? WHERE id = ?",
                           (f"stopped by {who} before it started", time.time(), run.id))
            elif run.status == "running":
                db.execute("UPDATE runs SET stop_requested = 1 WHERE id = ?", (run.id,))
            elif run.status == "failed" and run.reason.startswith(CANNOT_RESUME):
                why = run.reason.removeprefix(CANNOT_RESUME).removesuffix(f"; {TRIED_AGAIN}")
                db.execute("UPDATE runs SET status = 'stopped', reason = ?, stop_requested = 1, ended = ? WHERE id = ?",
                           (f"stopped by {who} after it could not resume: {why}", time.time(), run.id))
            _audit(db, who, "stop", run.id, run.status)
            return run
        return self._run_write(write)

    def stop_requested(self, run_id: int) -> bool:
        """Whether someone asked running run ``run_id`` to stop."""
        return bool(self._read("SELECT stop_requested FROM runs WHERE id = ?", (run_id,))[0][0])

    def recover(self) -> list[int]:
        """After a crash: every run left running is queued again (it resumes from its checkpoint), or ends stopped
        if a stop was asked for; returns the ids queued again."""
        def write(db):
            stuck = db.execute("SELECT id, stop_requested FROM runs WHERE status = 'running'").fetchall()
            for run_id, stop in stuck:
                if stop:
                    db.execute("UPDATE runs SET status = 'stopped', reason = 'stopped (the service ended first)', "
                               "ended = ? WHERE id = ?", (time.time(), run_id))
                else:
                    db.execute("UPDATE runs SET status = 'queued', reason = 'resumed after the service ended "
                               "during it' WHERE id = ?", (run_id,))
            return [run_id for run_id, stop in stuck if not stop]
        return self._run_write(write)

    def retry(self) -> list[int]:
        """Queue again every failed run that could not resume (its reason starts with CANNOT_RESUME: its checkpoint
        may have been mended since) and that no one asked to stop; returns their ids."""
        def write(db):
            again = [run_id for (run_id,) in db.execute(
                "SELECT id FROM runs WHERE status = 'failed' AND stop_requested = 0 AND substr(reason, 1, length(?)) "
                "= ?", (CANNOT_RESUME, CANNOT_RESUME))]
            db.executemany("UPDATE runs SET status = 'queued', reason = 'tried again: it could not resume before', "
                           "ended = NULL WHERE id = ?", [(run_id,) for run_id in again])
            return again
        return self._run_write(write)

    # ----------------------------------------------------------------- a run's log
    def log(self, run_id: int, line: str) -> None:
        """Add ``line`` to the log of ``run_id`` (what 'fedpar run logs' shows beside the rounds)."""
        self._run_write(lambda db: db.execute("INSERT INTO run_log (run_id, at, line) VALUES (?, ?, ?)",
                                              (run_id, time.time(), line)))

    def timeline(self, run_id: int, after_line: int = 0, after_round: int = 0) -> list[tuple[str, int, Any]]:
        """The log lines of ``run_id`` with ids above ``after_line`` and its rounds after ``after_round``, in the
        order they were written: ("line", id, text) and ("round", round, metrics row)."""
        rows = self._read("SELECT 'line', id, line, at FROM run_log WHERE run_id = ? AND id > ? UNION ALL "
                          "SELECT 'round', round, metrics, COALESCE(at, 0) FROM round_metrics WHERE run_id = ? "
                          "AND round > ? ORDER BY 4, 2", (run_id, after_line, run_id, after_round))
        return [(kind, key, json.loads(text) if kind == "round" else text) for kind, key, text, _ in rows]

    # ----------------------------------------------------------------- audit
    def audit(self, who: str, action: str, run_id: int | None = None, detail: str = "") -> None:
        """Write a control action to the audit table."""
        self._run_write(lambda db: _audit(db, who, action, run_id, detail))

    def audit_rows(self) -> list[dict]:
        """The audit table, oldest first."""
        return [dict(zip(("at", "who", "action", "run_id", "detail"), row)) for row in
                self._read("SELECT at, who, action, run_id, detail FROM audit ORDER BY id")]


_COLUMNS = ("id, name, settings, status, round, last_metrics, out_dir, model_path, reason, stop_requested, created, "
            "started, ended")


def _run(row: tuple) -> Run:
    (run_id, name, settings, status, round_id, last, out_dir, model_path, reason, stop, created, started,
     ended) = row
    return Run(run_id, name, json.loads(settings), status, round_id, json.loads(last), out_dir, model_path, reason,
               bool(stop), created, started, ended)


def _audit(db: sqlite3.Connection, who: str, action: str, run_id: int | None, detail: str) -> None:
    db.execute("INSERT INTO audit (at, who, action, run_id, detail) VALUES (?, ?, ?, ?, ?)",
               (time.time(), who, action, run_id, detail))


def _explain(path: str, exc: sqlite3.DatabaseError) -> str:
    """One line on why the state file at ``path`` cannot be used."""
    text = str(exc)
    if "locked" in text or "busy" in text:
        return f"state file {path} is locked by another process (another fedpar serve?); stop it or use another --state"
    if "not a database" in text or "malformed" in text or "corrupt" in text:
        return (f"state file {path} is not a fedpar state database or is damaged ({text}); move it aside (with "
                f"{path}.runs, its runs' outputs) and start again, or give another --state")
    if "unable to open" in text and os.path.isdir(path):  # sqlite says only 'unable to open database file'
        return _a_folder(path)
    if "unable to open" in text:  # or of the files beside it (WAL mode): a folder there, or one it may not write
        return (f"state file {path}: {text}; SQLite keeps {path}-wal and {path}-shm beside it: each must be a file "
                "this user may write, or not there (move aside what is in the way), or give another --state")
    if "disk I/O error" in text:  # what sqlite says of a write the disk refused (EFBIG, EIO; ENOSPC says "full")
        return f"state file {path}: disk I/O error (a full disk, or a failing one: see the system's log)"
    return f"state file {path}: {text}"
