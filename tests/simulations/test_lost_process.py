"""`kill -9` of a real `fedpar simulate --aggregator-ranks 2` (the launcher, whose child runs the simulation): the
simulation stops as on SIGTERM, writing what completed, and every other process (rank 0, rank 1, the workers) leaves
within seconds, with no traceback. The loss of rank 0 or another rank is survived (tests/simulations/test_rank_loss.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from support.processes import children, dump_stacks

ROOT = Path(__file__).resolve().parents[2]


def _simulate(tmp: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fedpar.cli.main", "simulate", "--aggregator-ranks", "2", "--clients", "4",
           "--workers", "1", "--rounds", "400", "--local-epochs", "1", "--out", str(tmp / "out"), "--quiet"]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _after_rounds(tmp: Path, proc: subprocess.Popen, rounds: int) -> None:
    metrics = tmp / "out" / "metrics.jsonl"
    end = time.monotonic() + 120
    while time.monotonic() < end and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= rounds:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {rounds} rounds: {proc.poll()} {proc.stderr.read() if proc.poll() is not None else ''}")


def test_kill_9_of_simulate_takes_every_other_process_with_it(tmp_path):
    proc = _simulate(tmp_path)
    try:
        _after_rounds(tmp_path, proc, 2)
        others = children(proc.pid)
        others += [p for child in others for p in children(child)]
        assert len(others) >= 4, others  # rank 0 (the coordinator), its resource tracker, the worker, rank 1
        os.kill(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
        end = time.monotonic() + 20
        while time.monotonic() < end and any(Path(f"/proc/{p}").exists() for p in others):
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    left = [p for p in others if Path(f"/proc/{p}").exists()
            and (Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z")]
    assert not left, left
    assert "Traceback" not in err, err
    assert "interrupted after" in err, err  # rank 0 stopped as on SIGTERM, and said what completed


def test_kill_usr1_prints_the_stacks_of_every_process_and_the_run_goes_on(tmp_path):
    proc = _simulate(tmp_path)
    try:
        _after_rounds(tmp_path, proc, 2)
        asked = dump_stacks(proc.pid)
        assert len(asked) >= 4, asked  # the launcher, rank 0 (the coordinator), rank 1, the worker
        done = len((tmp_path / "out" / "metrics.jsonl").read_text().splitlines())
        _after_rounds(tmp_path, proc, done + 2)  # nothing stopped
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert err.count("(most recent call first)") >= len(asked), err[-3000:]  # each process: a stack per thread
    assert "_rank_main" in err and "run_worker_process" in err, err[-3000:]  # rank 1's and the worker's own
    assert "Traceback" not in err, err
