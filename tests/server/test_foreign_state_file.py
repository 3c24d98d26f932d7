"""`fedpar serve --state PATH` where PATH is another application's SQLite database is refused in one line, the file
left as it was (it wrote fedpar's tables into it, and switched it to WAL mode). A new file, an empty one, fedpar's
own state file and one made before fedpar marked its files (PRAGMA application_id) are still taken. Real SQLite
files, and a real `fedpar serve --state` process."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedpar.cli.main import main
from fedpar.server.run_store import APPLICATION_ID, MIGRATIONS, SCHEMA_VERSION, RunStore, StoreError
from support.in_process import run_main
from support.processes import stop_processes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A certificate folder with an operator (the control port needs mutual TLS)."""
    folder = tmp_path_factory.mktemp("certs") / "certs"
    assert main(["certs", "--out", str(folder), "--operators", "op"]) == 0
    return folder


def _foreign(path: Path, mark: int = 0) -> bytes:
    """Another application's database at ``path`` (``mark``: its own application_id); its bytes."""
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT); INSERT INTO users VALUES (1, 'ann');"
                     "CREATE TABLE orders (id INTEGER PRIMARY KEY, user INTEGER);"
                     f"PRAGMA application_id = {mark};")
    db.close()
    return path.read_bytes()


def _serve(state: Path, certs: Path, *more: str) -> list[str]:
    return ["serve", "--state", str(state), "--certs", str(certs), "--port", "0", "--control-port", "0", *more]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mark", [0, 0x4D594150], ids=["unmarked", "marked by its application"])
def test_serve_refuses_another_applications_database_in_one_line_and_touches_nothing(tmp_path, certs, mark, capfd):
    state = tmp_path / "app.db"
    before = _foreign(state, mark)
    # serve's main in this process (the refusal is what is checked, not a process's start); a service that took the
    # file would serve until stopped: the test's time limit ends it
    done = run_main(_serve(state, certs), capfd, cwd=ROOT)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and done.stderr.splitlines() == [
        f"fedpar serve: --state {state} is a SQLite database of another application (tables: orders, users); give "
        "a new file or fedpar's own state file"], done.stderr
    assert state.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]  # no lock file, -wal, -shm or .runs folder
    assert sqlite3.connect(state).execute("PRAGMA journal_mode").fetchone()[0] == "delete"


def test_the_run_store_refuses_it_too_and_takes_new_empty_and_older_fedpar_files(tmp_path):
    foreign = tmp_path / "app.db"
    _foreign(foreign)
    with pytest.raises(StoreError, match="is a SQLite database of another application"):
        RunStore(foreign)
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")  # e.g. made by touch (or mktemp) for the service
    RunStore(empty).close()
    older = tmp_path / "older.db"  # made by a fedpar before its files were marked
    db = sqlite3.connect(older)
    db.executescript("CREATE TABLE schema_version (version INTEGER NOT NULL); INSERT INTO schema_version VALUES (1);"
                     + MIGRATIONS[0])
    db.close()
    for path in (tmp_path / "new.db", empty, older):
        store = RunStore(path)
        store.submit("a", {})
        store.close()
        again = RunStore(path)  # and again, as fedpar's own
        assert (again.schema_version(), len(again.runs())) == (SCHEMA_VERSION, 1)
        again.close()
        assert sqlite3.connect(path).execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID


def _start_and_stop(state: Path, certs: Path, tmp: Path) -> str:
    """A real `fedpar serve --state` until it says its ports are up, then SIGTERM; what it said."""
    port_file = tmp / "cport"
    port_file.unlink(missing_ok=True)
    with open(tmp / "serve.log", "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "fedpar", *_serve(state, certs, "--control-port-file",
                                                                            str(port_file))],
                                   cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            end = time.monotonic() + 60
            # its line after the control port's file: a stop between the two (CI, under load) left it unsaid
            while ("fedpar service: agents on" not in (tmp / "serve.log").read_text() and process.poll() is None
                   and time.monotonic() < end):
                time.sleep(0.1)
            assert process.poll() is None and port_file.exists(), (tmp / "serve.log").read_text()
        finally:
            stop_processes(process, wait=30)
    return (tmp / "serve.log").read_text()


def test_serve_starts_on_an_empty_file_and_again_on_the_state_file_it_made(tmp_path, certs):
    state = tmp_path / "state.db"
    state.write_bytes(b"")
    for _ in range(2):
        said = _start_and_stop(state, certs, tmp_path)
        assert "fedpar service: agents on" in said and "another application" not in said, said
    assert sqlite3.connect(state).execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
