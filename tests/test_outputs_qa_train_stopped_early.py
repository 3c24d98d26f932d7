"""`fedpar train` stopped by Ctrl-C before it logged a step: its --out folder holds no metrics.jsonl, and so no
metrics.csv either (it was a file of one empty line, which a CSV reader such as pandas refuses: 'No columns to parse
from file'); once it logged one, the table holds its rows under a header."""

from __future__ import annotations

import csv
import json

from fedpar.parallel.metrics import write_interrupted_summary


def test_a_run_stopped_before_its_first_logged_step_writes_no_empty_table(tmp_path):
    summary = write_interrupted_summary(tmp_path, "mlp", "digits", 1, 0.4, {}, kept_step=2)
    assert summary["steps"] == 2 and summary["interrupted"]
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2
    assert not (tmp_path / "metrics.jsonl").exists()
    assert not (tmp_path / "metrics.csv").exists()


def test_a_run_stopped_after_a_logged_step_writes_its_rows_as_a_table(tmp_path):
    row = {"kind": "train", "step": 5, "epoch": 0, "loss": 2.25, "lr": 0.05, "samples_per_second": 900.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    write_interrupted_summary(tmp_path, "mlp", "digits", 1, 0.4, {}, kept_step=6)
    with open(tmp_path / "metrics.csv", newline="") as fh:
        assert list(csv.DictReader(fh)) == [{k: str(v) for k, v in row.items()}]
