"""A `fedpar simulate` whose --out folder is made read-only while it runs (as a full volume, or an operator's chmod,
would leave it): at the end it cannot write its model, and it says so in one line naming that file (exit 1, no
traceback), not that it could not take away its own lock file; the rows it logged stay whole in both tables.

A real process, as the claim is about its permissions: it runs without the capabilities that let root write into a
read-only folder."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from support.processes import DROP_ROOT_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 4


def _rows(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def test_an_out_folder_made_read_only_mid_run_is_said_in_one_line_naming_the_model(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-c", DROP_ROOT_OVERRIDES, sys.executable, "-m", "fedpar", "simulate", "--dataset",
           "digits", "--clients", "2", "--workers", "1", "--rounds", str(ROUNDS), "--local-epochs", "1",
           "--slow-fraction", "1", "--slow-step-delay", "0.01", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        end = time.monotonic() + 60
        # both tables hold round 1 (the CSV's file is made at its first row, after the JSON lines' row; a folder
        # made read-only between the two is said naming metrics.csv, rightly, but that is not this test's claim)
        while (_rows(out / "metrics.jsonl") < 1 or _rows(out / "metrics.csv") < 2) and proc.poll() is None \
                and time.monotonic() < end:
            time.sleep(0.02)
        out.chmod(0o555)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
        out.chmod(0o755)
    lines = stderr.strip().splitlines()
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr
    assert len(lines) == 1, stderr
    assert "global.safetensors" in lines[0] and "Permission denied" in lines[0], lines[0]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == list(range(1, ROUNDS + 1))
    with open(out / "metrics.csv", newline="") as fh:
        table = list(csv.DictReader(fh))
    assert [int(row["round"]) for row in table] == list(range(1, ROUNDS + 1))
    assert [float(row["test_accuracy"]) for row in table] == [row["test_accuracy"] for row in rows]
