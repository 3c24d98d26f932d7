"""An interrupted `fedpar train` wrote summary.json with its last evaluation (taken at the end of the last whole
epoch) and last logged train loss beside a later ``steps``, so a reader took them for that step's. The summary now
says the step each was taken at (``evaluated_at_step``, ``train_loss_at_step``), as an uninterrupted run's does
(both its last step there), and keeps the keys older readers use. Real `fedpar train` processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

FEDPAR = [sys.executable, "-m", "fedpar"]
RUN = ["train", "--model", "mlp", "--dataset", "digits", "--log-every", "2", "--device", "cpu", "--no-plot"]


def _rows(out: Path, kind: str) -> list[dict]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines[:-1] if lines and not lines[-1].endswith("}") else lines)
            if r["kind"] == kind]


def test_an_interrupted_runs_summary_says_the_step_of_its_last_evaluation_and_train_loss(tmp_path):
    out = tmp_path / "run"
    err = tmp_path / "err"
    with err.open("w") as stderr:
        proc = subprocess.Popen([*FEDPAR, *RUN, "--max-steps", "100000", "--out", str(out)], cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=stderr, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            end = time.monotonic() + 120
            while True:  # an evaluation logged, and a train row after it: the stop comes between two evaluations
                evals = _rows(out, "eval")
                if evals and any(r["step"] > evals[-1]["step"] for r in _rows(out, "train")):
                    break
                assert proc.poll() is None and time.monotonic() < end, err.read_text()
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 143, err.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    summary = json.loads((out / "summary.json").read_text())
    last_eval, last_train = _rows(out, "eval")[-1], _rows(out, "train")[-1]
    assert summary["interrupted"] is True
    assert summary["evaluated_at_step"] == last_eval["step"] < summary["steps"], summary
    assert summary["train_loss_at_step"] == last_train["step"] <= summary["steps"], summary
    # the keys older readers take stay as they were
    assert summary["test_loss"] == last_eval["test_loss"] and summary["test_accuracy"] == last_eval["test_accuracy"]
    assert summary["final_train_loss"] == last_train["loss"]


def test_an_uninterrupted_runs_summary_says_its_last_step_for_both(tmp_path):
    out = tmp_path / "run"
    run = subprocess.run([*FEDPAR, *RUN, "--max-steps", "30", "--out", str(out)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr
    summary = json.loads((out / "summary.json").read_text())
    last_eval, last_train = _rows(out, "eval")[-1], _rows(out, "train")[-1]
    assert summary["steps"] == summary["evaluated_at_step"] == summary["train_loss_at_step"] == 30, summary
    assert last_eval["step"] == last_train["step"] == 30
    assert summary["test_loss"] == last_eval["test_loss"] and summary["final_train_loss"] == last_train["loss"]
    assert "interrupted" not in summary
