"""The coordinator's metrics log holds no history: summary.json's figures are running ones (equal to summarizing
every row), metrics.csv is appended in steady state, and a restart repairs both files' ends in place, reading
neither whole."""

from __future__ import annotations

import csv
import json
import random
import tracemalloc

import grpc
import numpy as np
import pytest

from fedpar.protocol.run_logs import RoundMetricsLog, RunningSummary, read_rows


def _added_in_order(values) -> float:
    """The values added one after another, as a running sum does (Python 3.12's sum() compensates its rounding)."""
    total = 0.0
    for value in values:
        total += value
    return total


def reference_summary(rows: list[dict], target_accuracy: float | None = None) -> dict:
    """summarize_rounds as it was before the running summary (every row in memory): the oracle."""
    summary = {
        "final_test_accuracy": rows[-1].get("test_accuracy") if rows else None,
        # rows with no accuracy are not a 0.0 one: a run that evaluated nothing has no best (a Flower ServerApp's)
        "best_test_accuracy": max((r["test_accuracy"] for r in rows if r.get("test_accuracy") is not None),
                                  default=None),
        "rounds": len(rows),
        "failed_rounds": sum(r["status"] != "ok" for r in rows),
        "mean_round_seconds": _added_in_order(r["round_seconds"] for r in rows) / len(rows) if rows else None,
        "mean_upload_bytes_per_round": sum(r["upload_bytes"] for r in rows) / len(rows) if rows else None,
    }
    if rows and "dp_epsilon" in rows[-1]:
        summary["final_dp_epsilon"] = rows[-1]["dp_epsilon"]
    if rows and "sim_seconds" in rows[-1]:
        summary["sim_seconds"] = rows[-1]["sim_seconds"]
    if target_accuracy is not None:
        hit = next((r for r in rows if r.get("test_accuracy") is not None and r["test_accuracy"] >= target_accuracy),
                   None)
        summary.update({"target_accuracy": target_accuracy, "rounds_to_target": hit["round"] if hit else None,
                        "wall_seconds_to_target": hit["wall_seconds"] if hit else None})
        if rows and "sim_seconds" in rows[-1]:
            summary["sim_seconds_to_target"] = hit["sim_seconds"] if hit else None
    return summary


def random_rows(rng: random.Random, n: int, dp: bool, sim: bool) -> list[dict]:
    """``n`` rows as a coordinator writes them: ok and failed rounds, accuracy missing, None or a value."""
    rows, wall, sim_seconds = [], 0.0, 0.0
    for r in range(1, n + 1):
        seconds = rng.uniform(0.01, 30.0)
        wall += seconds + rng.random()
        row = {"round": r, "status": rng.choice(["ok", "ok", "ok", "failed"]), "round_seconds": seconds,
               "upload_bytes": rng.choice([0, rng.randrange(1, 10**9)]), "wall_seconds": wall}
        accuracy = rng.choice(["missing", None, 0.0, 0, 1, round(rng.random(), 2), rng.random()])
        if accuracy != "missing":
            row["test_accuracy"] = accuracy
        if dp and rng.random() < 0.8:
            row["dp_epsilon"] = rng.choice([None, rng.uniform(0, 10)])
        if sim:
            sim_seconds += rng.uniform(0, 100)
            row["sim_seconds"] = sim_seconds
        rows.append(row)
    return rows


def test_the_running_summary_equals_summarizing_every_row_on_random_runs():
    rng = random.Random(33)
    for trial in range(400):
        rows = random_rows(rng, rng.randrange(0, 40), dp=rng.random() < 0.5, sim=rng.random() < 0.5)
        target = rng.choice([None, 0.0, 0.5, round(rng.random(), 2), 1.5])
        running = RunningSummary(target)
        split = rng.randrange(0, len(rows) + 1)
        for row in rows[:split]:
            running.add(row)
        running = RunningSummary.from_state(json.loads(json.dumps(running.state())))  # through a checkpoint
        for row in rows[split:]:
            running.add(row)
        expected = reference_summary(rows, target)
        got = running.result()
        assert list(got.items()) == list(expected.items()), (trial, rows, target)
        for key, value in got.items():  # the same types too: ints stay ints, floats bit for bit
            assert type(value) is type(expected[key]), (trial, key)


def test_a_damaged_running_summary_is_refused():
    good = RunningSummary(0.5).state()
    for bad in ({}, {**good, "rounds": "3"}, {**good, "rounds": 1.5}, {**good, "extra": 1},
                {**good, "last": {"loss": 1.0}}, {**good, "round_seconds_sum": float("nan")}, [good]):
        with pytest.raises(ValueError, match="not a running summary"):
            RunningSummary.from_state(bad)


def _row(r: int, **extra) -> dict:
    """A row as the coordinator writes it (the columns of a plain FedAvg round with central evaluation)."""
    return {"round": r, "status": "ok", "sampled": 3, "reported": 2, "rejected": 0, "late": 1, "examples": 300,
            "close_reason": "target", "cohort_digest": f"{r:016x}", "train_loss": 1.0 / r, "upload_bytes": 4096,
            "download_bytes": 8192, "r0_uploads": 2.0, "r0_bytes": 4096.0, "r0_fold_s": 0.001, "num_updates": 2.0,
            "test_loss": 2.0 / r, "test_accuracy": r / (r + 1), "round_seconds": 0.5, "wall_seconds": 0.5 * r,
            **extra}


DECLARED = ["refused_resource_exhausted", "refused_invalid_argument"]


def _logged(folder, rows: list[dict]) -> RoundMetricsLog:
    """A log that took ``rows`` one by one, as a coordinator that never crashed."""
    log = RoundMetricsLog(folder / "metrics.jsonl", DECLARED)
    for row in rows:
        log.append(row)
    return log


def _rounds(path) -> list[int]:
    return [r["round"] for r in read_rows(path)]


@pytest.mark.parametrize("damage", ["rounds after the checkpoint", "torn last line", "crash before its line",
                                    "csv one row behind", "csv torn", "csv header torn", "csv missing"])
def test_resume_keeps_exactly_the_rows_up_to_the_checkpointed_round_in_both_files(tmp_path, damage):
    rows = [_row(r) for r in range(1, 7)]
    last = 4  # the checkpointed round
    run = _logged(tmp_path / "run", rows)
    jsonl, table = run.path, run.csv_path
    if damage == "torn last line":
        with jsonl.open("ab") as fh:
            fh.write(b'{"round": 7, "status": "o')
    if damage == "crash before its line":  # the checkpoint of round 4 was written, its lines were not
        _cut_after(jsonl, 3)
        _cut_after(table, 3)
    if damage == "csv one row behind":  # killed between the two files' writes
        _cut_after(table, 3)
    if damage == "csv torn":
        with table.open("ab") as fh:
            fh.write(b"7,ok,3,")
    if damage == "csv header torn":  # killed while the first row started the table (it is appended, not renamed)
        table.write_bytes(table.read_bytes()[:7])
    if damage == "csv missing":
        table.unlink()
    summary = _logged(tmp_path / "summary-only", rows[:last]).summary.state()  # what the checkpoint holds

    log = RoundMetricsLog(jsonl, DECLARED)
    log.resume(last, rows[last - 1], summary)
    assert _rounds(jsonl) == [1, 2, 3, 4] and log.last["round"] == 4
    expected = _logged(tmp_path / "expected", rows[:last])
    assert jsonl.read_bytes() == expected.path.read_bytes()
    assert table.read_bytes() == expected.csv_path.read_bytes()
    assert log.summary.result() == reference_summary(rows[:last])
    log.append(_row(5))  # and the run goes on from there
    assert _rounds(jsonl) == [1, 2, 3, 4, 5]
    assert [int(r["round"]) for r in csv.DictReader(table.open())] == [1, 2, 3, 4, 5]


def test_a_resume_into_another_folder_starts_with_the_runs_earlier_rows(tmp_path):
    # it held only the rows from the checkpointed round on: the plots and tables of the new folder began there
    rows = [_row(r) for r in range(1, 7)]
    first = _logged(tmp_path / "first", rows)  # a crash after round 6; the checkpoint is round 4's
    summary = _logged(tmp_path / "summary-only", rows[:4]).summary.state()
    log = RoundMetricsLog(tmp_path / "second" / "metrics.jsonl", DECLARED)
    assert log.resume(4, rows[3], summary, earlier=str(first.path))
    assert _rounds(log.path) == [1, 2, 3, 4] and _rounds(first.path) == [1, 2, 3, 4, 5, 6]  # the first is left as is
    assert [int(r["round"]) for r in csv.DictReader(log.csv_path.open())] == [1, 2, 3, 4]
    log.append(_row(5))
    assert _rounds(log.path) == [1, 2, 3, 4, 5]


def test_a_resume_whose_earlier_rows_are_gone_says_so_and_starts_at_the_checkpoint(tmp_path):
    rows = [_row(r) for r in range(1, 5)]
    summary = _logged(tmp_path / "summary-only", rows).summary.state()
    log = RoundMetricsLog(tmp_path / "second" / "metrics.jsonl", DECLARED)
    assert not log.resume(4, rows[3], summary, earlier=str(tmp_path / "deleted" / "metrics.jsonl"))
    assert _rounds(log.path) == [4] and log.summary.result() == reference_summary(rows)


def test_a_runs_first_row_starts_metrics_csv_anew(tmp_path):
    stale = _logged(tmp_path / "old", [_row(r) for r in range(1, 4)])  # an earlier run's files in the same folder
    stale.path.unlink()
    log = RoundMetricsLog(stale.path, DECLARED)
    log.append(_row(1))
    assert stale.csv_path.read_bytes() == _logged(tmp_path / "expected", [_row(1)]).csv_path.read_bytes()
    assert [int(r["round"]) for r in csv.DictReader(stale.csv_path.open())] == [1]


def _cut_after(path, round_id: int) -> None:
    """Drop the lines of ``path`` (metrics.jsonl, or metrics.csv: its header stays) after round ``round_id``'s."""
    lines = path.read_bytes().splitlines(keepends=True)
    if path.suffix == ".csv":
        keep = lines[:1] + [line for line in lines[1:] if int(line.split(b",", 1)[0]) <= round_id]
    else:
        keep = [line for line in lines if json.loads(line)["round"] <= round_id]
    path.write_bytes(b"".join(keep))


def test_a_restart_reads_neither_file_whole(tmp_path):
    """50,000 rounds on disk (about 30 MB): resuming takes the checkpoint's summary and cuts each file's end in
    place, in well under 1 MiB of Python memory; a checkpoint without a summary has it counted, streaming."""
    rows = 50_000
    jsonl, table = tmp_path / "metrics.jsonl", tmp_path / "metrics.csv"
    template = _row(1)
    columns = list(template) + DECLARED
    with jsonl.open("w") as lines, table.open("w") as cells:
        cells.write(",".join(columns) + "\n")
        for r in range(1, rows + 3):  # two rows of rounds after the checkpointed one, then a torn line
            row = {**template, "round": r, "cohort_digest": f"{r:016x}", "wall_seconds": 0.5 * r}
            lines.write(json.dumps(row) + "\n")
            cells.write(",".join(str(row.get(c, "")) for c in columns) + "\n")
        lines.write('{"round": 50003, "sta')
    running = RunningSummary()
    for row in read_rows(jsonl):
        if row["round"] <= rows:
            running.add(row)
    for summary in (running.state(), None):
        log = RoundMetricsLog(jsonl, DECLARED)
        tracemalloc.start()
        log.resume(rows, {**template, "round": rows}, summary)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 1 << 20, peak
        assert log.summary.result() == running.result() and log.last["round"] == rows
        assert log._csv.rewrites == 0
    with jsonl.open("rb") as fh:
        assert sum(1 for _ in fh) == rows
    with table.open("rb") as fh:
        assert sum(1 for _ in fh) == rows + 1
    assert json.loads(jsonl.read_bytes()[-1000:].splitlines()[-1])["round"] == rows
    assert table.read_bytes()[-1000:].splitlines()[-1].startswith(f"{rows},".encode())


def test_metrics_csv_of_a_real_coordinator_is_appended_never_rewritten(start_coordinator, agents, tmp_path):
    """Rounds over real gRPC, one with a refused upload (a column the first rows did not have, but declared):
    the table keeps its inode and first bytes, every round adds one line, and nothing is rewritten."""
    init = [np.zeros((4, 3), np.float32), np.zeros(3, np.float32)]
    server = start_coordinator(init, rounds=4, min_available=1, clients_per_round=1,
                               metrics_path=tmp_path / "out" / "metrics.jsonl")
    log = server.coordinator.metrics
    seen = []  # per round: the table's inode, its first bytes and its lines, when the round's row is logged
    server.coordinator.on_round_end.append(
        lambda row: seen.append((log.csv_path.stat().st_ino, log.csv_path.read_bytes()[:64],
                                 len(log.csv_path.read_bytes().splitlines()))))
    (bot,) = agents(server.address, ["a"])
    refused = None
    for r in range(1, 5):
        task = bot.task()
        if r == 3:  # an upload naming another task is refused: the row gains a refused_<status> column
            forged = type(task)()
            forged.CopyFrom(task)
            forged.task_id = "not-my-task"
            with pytest.raises(grpc.RpcError) as err:
                bot.upload(forged, [a + r for a in init], 10)
            refused = f"refused_{err.value.code().name.lower()}"
        assert bot.upload(task, [a + r for a in init], 10).accepted
    assert server.wait(30)
    assert [lines for _, _, lines in seen] == [2, 3, 4, 5]
    assert len({(inode, head) for inode, head, _ in seen}) == 1 and log._csv.rewrites == 0
    table = list(csv.DictReader(log.csv_path.open()))
    assert [t[refused] for t in table] == ["", "", "1", ""]
    assert [int(t["round"]) for t in table] == _rounds(log.path) == [1, 2, 3, 4]
