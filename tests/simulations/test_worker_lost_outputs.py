"""A `fedpar simulate` whose worker process dies mid-run (kill -9, the OOM killer) ends in one line with exit 1, and
keeps what the rounds before it came to: the rows, the model of the last completed round and a summary (QA: after
126 rounds, no global.safetensors nor summary.json was written)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from safetensors.numpy import load_file

from support.processes import children, stop_processes


def _worker_of(pid: int) -> int | None:
    """A worker process of simulate ``pid`` (a child that is not multiprocessing's resource tracker)."""
    for child in children(pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"resource_tracker" not in f.read():
                return child
    return None


def test_a_worker_killed_mid_run_ends_it_in_one_line_keeping_the_rounds_before(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "fedpar", "simulate", "--clients", "4", "--rounds", "100000",
                             "--local-epochs", "1", "--workers", "2", "--out", str(out), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics, end = out / "metrics.jsonl", time.monotonic() + 180
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < end, proc.communicate()
            time.sleep(0.05)
        worker = _worker_of(proc.pid)
        assert worker is not None
        os.kill(worker, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        stop_processes(proc)
    assert proc.returncode == 1, stderr
    said = [line for line in stderr.splitlines() if line.strip()]
    assert len(said) == 1 and "Traceback" not in stderr, stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    last = rows[-1]["round"]
    assert said[0].startswith("fedpar simulate: worker process fedpar-worker-"), said
    assert f"died with exit code -9; the run stopped after round {last} (wrote {out}/" in said[0], said
    assert "global.safetensors" in said[0] and "summary.json" in said[0], said
    model = json.loads((out / "global.json").read_text())
    assert model["round"] == last and load_file(out / "global.safetensors")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == last and summary["interrupted"] is True
