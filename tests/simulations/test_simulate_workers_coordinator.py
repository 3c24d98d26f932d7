"""What `fedpar simulate-workers` and its `fedpar serve --accept-populations` tell each other, as real processes on
127.0.0.1 (a population smaller than --min-available is said by serve: tests/server/test_host_leaves.py): a
worker stopped by a signal leaves, so the open round stops waiting for its members (it waited out --deadline, then
sampled them again); a worker whose coordinator is gone says so (it was silent); and a routine overselected run ends
without a warning on the workers (the surplus refused after its round closed was one)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.processes import port_in_file

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TASK = ["--dataset", "digits", "--model", "mlp"]


def _serve(tmp_path: Path, *options: str) -> tuple[subprocess.Popen, str]:
    """A one-shot `fedpar serve --accept-populations` on 127.0.0.1 and its address, once it listens."""
    serve = subprocess.Popen([sys.executable, "-m", "fedpar", "serve", "--insecure", "--accept-populations",
                              "--port", "0", "--port-file", str(tmp_path / "port"), "--out", str(tmp_path / "out"),
                              *TASK, *options], cwd=ROOT, env=ENV, stdout=open(tmp_path / "serve.log", "w"),
                             stderr=subprocess.STDOUT)
    return serve, f"127.0.0.1:{port_in_file(tmp_path / 'port', serve, tmp_path / 'serve.log')}"


def _worker(tmp_path: Path, server: str, *options: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedpar", "simulate-workers", "--insecure", "--server", server,
                             *TASK, *options], cwd=ROOT, env=ENV, stdout=open(tmp_path / "worker.log", "w"),
                            stderr=subprocess.STDOUT)


def _wait_for(path: Path, text: str, seconds: float) -> str:
    """``path``'s text once it holds ``text`` (an AssertionError after ``seconds``)."""
    end = time.monotonic() + seconds
    while text not in path.read_text():
        assert time.monotonic() < end, f"no {text!r} in {path.name}:\n{path.read_text()[-3000:]}"
        time.sleep(0.2)
    return path.read_text()


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_worker_stopped_by_a_signal_mid_task_exits_at_once_and_its_round_stops_waiting(tmp_path, stop):
    """It left the coordinator at once, then waited for the task each seat was on (up to a minute a seat) before
    it exited: here about half a member's 30 s; the open round, told the worker left, stops waiting for its members
    (it waited out --deadline, then sampled them again)."""
    serve, server = _serve(tmp_path, "--min-available", "4", "--clients-per-round", "4", "--rounds", "2",
                           "--deadline", "300", "--local-epochs", "1")
    # very slow members (3 s a step, about 10 steps each): both seats are mid-task when the worker is stopped
    worker = _worker(tmp_path, server, "--clients", "4", "--seats", "2", "--slow-fraction", "1",
                     "--slow-step-delay", "3")
    try:
        _wait_for(tmp_path / "serve.log", "round 1: sampled", 60)
        time.sleep(3)
        stopped = time.monotonic()
        worker.send_signal(stop)
        assert worker.wait(60) == 128 + stop
        took = time.monotonic() - stopped
        log = (tmp_path / "worker.log").read_text()
        assert took < 8, (took, log[-3000:])
        assert log.splitlines()[-1] == "fedpar simulate-workers: interrupted", log[-3000:]
        assert "Traceback" not in log and "failed" not in log, log[-3000:]
        log = _wait_for(tmp_path / "serve.log", "went silent before answering", 30)
        assert time.monotonic() - stopped < 30  # not --deadline's 300 s
        assert "simulation host host-0-of-1 left, with its 4 members" in log
        _wait_for(tmp_path / "serve.log", "waiting for 4 agents", 30)  # round 2 samples no departed member
        assert "round 2: sampled" not in (tmp_path / "serve.log").read_text()
    finally:
        _stop(worker, serve)


def test_a_worker_says_its_coordinator_is_gone_and_a_routine_run_ends_without_a_warning(tmp_path):
    """A routine overselected run ends with no warning on the worker; a coordinator stopped mid-run is said once."""
    serve, server = _serve(tmp_path, "--min-available", "20", "--clients-per-round", "10", "--rounds", "2",
                           "--overselect", "1.5", "--local-epochs", "1")
    worker = _worker(tmp_path, server, "--clients", "20")
    try:
        assert worker.wait(120) == 0, (tmp_path / "worker.log").read_text()
        assert serve.wait(60) == 0
        log = (tmp_path / "worker.log").read_text()
        assert "WARNING" not in log and "were refused" not in log, log
        (tmp_path / "port").unlink()
        serve, server = _serve(tmp_path, "--min-available", "20", "--rounds", "50", "--local-epochs", "1")
        worker = _worker(tmp_path, server, "--clients", "20")
        _wait_for(tmp_path / "serve.log", "round 2: sampled", 60)
        serve.send_signal(signal.SIGINT)
        serve.wait(60)
        log = _wait_for(tmp_path / "worker.log", "coordinator unreachable (UNAVAILABLE)", 30)
        assert worker.poll() is None and log.count("unreachable") == 1, log  # said once, still retrying
    finally:
        _stop(worker, serve)
