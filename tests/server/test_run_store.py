"""The run store: runs, round metrics and audit in SQLite, transactional, versioned, recovered after a crash."""

import json
import sqlite3
import subprocess
import sys

import pytest

from fedpar.server.run_store import SCHEMA_VERSION, RunStore, StoreError, UnknownRun


def test_runs_go_from_queued_to_finished_with_their_rounds_kept(tmp_path):
    path = tmp_path / "state.db"
    store = RunStore(path)
    first = store.submit("a", {"strategy": "fedavg", "rounds": 2}, who="alice")
    second = store.submit("b", {"strategy": "fedprox", "rounds": 1}, who="alice")
    assert store.next_queued().id == first
    store.start(first, str(tmp_path / "1"))
    store.record_round(first, {"round": 1, "status": "ok", "test_accuracy": 0.5})
    store.record_round(first, {"round": 2, "status": "ok", "test_accuracy": 0.7})
    store.end(first, "finished", model_path="m.safetensors")
    store.close()

    again = RunStore(path)  # everything committed is there after reopening
    run = again.get(first)
    assert (run.status, run.round, run.last_metrics["test_accuracy"], run.model_path) == \
        ("finished", 2, 0.7, "m.safetensors")
    assert [r["round"] for r in again.round_metrics(first)] == [1, 2]
    assert [r["round"] for r in again.round_metrics(first, after=1)] == [2]
    assert again.next_queued().id == second
    assert [(a["who"], a["action"], a["run_id"]) for a in again.audit_rows()] == \
        [("alice", "submit", first), ("alice", "submit", second)]
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_run_left_running_by_a_crash_is_queued_again_and_a_stopped_one_ends(tmp_path):
    path = tmp_path / "state.db"
    store = RunStore(path)
    resumed, stopping = store.submit("a", {}), store.submit("b", {})
    store.start(resumed, "x")
    store.start(stopping, "y")
    store.request_stop(stopping, who="bob")
    store.close()  # as a kill -9 would leave it: two runs "running"
    again = RunStore(path)
    assert again.recover() == [resumed]
    assert again.get(resumed).status == "queued" and "resumed" in again.get(resumed).reason
    assert again.get(stopping).status == "stopped"
    assert not [r for r in again.runs() if r.status == "running"]


def test_stopping_a_queued_run_ends_it_and_unknown_ids_say_so(tmp_path):
    store = RunStore()
    run_id = store.submit("a", {})
    store.request_stop(run_id, who="carol")
    assert store.get(run_id).status == "stopped" and store.next_queued() is None
    with pytest.raises(UnknownRun, match="no run with id 99"):
        store.get(99)
    with pytest.raises(UnknownRun):
        store.request_stop(99)
    with pytest.raises(ValueError):
        store.end(run_id, "running")


def test_an_older_schema_is_migrated_and_a_newer_one_refused(tmp_path):
    path = tmp_path / "state.db"
    db = sqlite3.connect(path)  # version 1: runs and rounds, no audit table yet
    from fedpar.server.run_store import MIGRATIONS
    db.executescript("CREATE TABLE schema_version (version INTEGER NOT NULL); INSERT INTO schema_version VALUES (1);"
                     + MIGRATIONS[0])
    db.close()
    store = RunStore(path)
    assert store.schema_version() == SCHEMA_VERSION
    store.audit("dave", "ls")
    assert store.audit_rows()[0]["who"] == "dave"
    store.close()
    db = sqlite3.connect(path)
    db.execute("UPDATE schema_version SET version = 99")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="newer than this fedpar"):
        RunStore(path)


def test_a_corrupt_file_is_one_clear_error_and_left_as_it_was(tmp_path):
    path = tmp_path / "state.db"
    path.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(StoreError, match="not a fedpar state database or is damaged"):
        RunStore(path)
    assert path.read_bytes() == b"this is not sqlite at all" * 100


def test_a_run_log_interleaves_its_lines_and_rounds_in_the_order_written(tmp_path):
    store = RunStore(tmp_path / "state.db")
    run_id = store.submit("a", {})
    other = store.submit("b", {})
    store.log(run_id, "started")
    store.record_round(run_id, {"round": 1, "status": "ok"})
    store.log(run_id, "agent a2 is skipped")
    store.log(other, "not this run's")
    store.record_round(run_id, {"round": 2, "status": "ok"})
    store.log(run_id, "finished")
    timeline = store.timeline(run_id)
    assert [(kind, entry if kind == "line" else entry["round"]) for kind, _, entry in timeline] == \
        [("line", "started"), ("round", 1), ("line", "agent a2 is skipped"), ("round", 2), ("line", "finished")]
    last_line = timeline[2][1]
    assert [entry for _, _, entry in store.timeline(run_id, after_line=last_line, after_round=2)] == ["finished"]


def test_a_state_file_locked_by_another_writer_is_one_clear_error(tmp_path):
    path = tmp_path / "state.db"
    RunStore(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # e.g. someone's sqlite3 shell in the middle of a write
    try:
        with pytest.raises(StoreError, match="is locked by another process") as caught:
            RunStore(path, busy_seconds=0.2)
        assert "\n" not in str(caught.value)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert RunStore(path).schema_version() == SCHEMA_VERSION  # nothing lost: usable once the lock is gone


def test_an_in_memory_store_keeps_a_runs_last_row_only_so_a_long_one_shot_run_does_not_grow(tmp_path):
    store = RunStore(":memory:")
    run_id = store.submit("one-shot", {"rounds": 1000})
    store.start(run_id, str(tmp_path))
    for round_id in range(1, 1001):
        store.record_round(run_id, {"round": round_id, "status": "ok", "test_accuracy": round_id / 1000})
    run = store.get(run_id)
    assert (run.round, run.last_metrics["test_accuracy"]) == (1000, 1.0)
    assert store.round_metrics(run_id) == []  # metrics.jsonl holds the one-shot form's history


# In a process of its own: the file-size limit (a full disk as the process sees it: writes beyond it fail) holds for
# every thread of the process that sets it.
FULL_DISK = """
import json, os, resource, signal, sys
from fedpar.server.run_store import RunStore, StoreError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing the process
path = sys.argv[1]
store = RunStore(path)
kept = store.submit("kept", {"rounds": 1})
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path + "-wal") + 50_000, hard))
try:
    store.submit("too big", {"blob": "x" * 400_000})
    refusal = None
except StoreError as exc:
    refusal = str(exc)
during = [r.name for r in store.runs()]
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
later = store.submit("later", {"rounds": 1})
store.close()
print(json.dumps({"refusal": refusal, "during": during, "kept": kept, "later": later}))
"""


def test_a_write_the_disk_cannot_hold_is_one_clear_error_rolled_back_and_the_store_goes_on(tmp_path):
    path = tmp_path / "state.db"
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert said["refusal"] == (f"state file {path}: disk I/O error (a full disk, or a failing one: see the system's "
                               "log)")  # one line, naming the file
    assert said["during"] == ["kept"]  # the refused write left no row, and the store's lock is free again
    assert [(r.id, r.name) for r in RunStore(path).runs()] == [(said["kept"], "kept"), (said["later"], "later")]
