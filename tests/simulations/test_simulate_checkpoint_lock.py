"""`fedpar simulate --checkpoint-dir` runs its coordinator in a child that its launcher restarts. QA: two runs could
use one checkpoint folder at once (the second resumed from the first's live checkpoints, both wrote --out), and a
SIGINT to the child's pid was ignored. The folder is locked by the launcher for the run's life, across restarts; a
SIGINT or SIGTERM to the child stops the run as one to the launcher does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.in_process import run_main as run_main
from support.processes import coordinator_child

SIMULATE = [sys.executable, "-m", "fedpar", "simulate", "--clients", "20", "--clients-per-round", "4", "--quiet",
            "--checkpoint-dir", "D", "--out", "O"]


def _start(cwd: Path, rounds: int = 2000) -> subprocess.Popen:
    return subprocess.Popen(SIMULATE + ["--rounds", str(rounds)], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _until_checkpointed(run: subprocess.Popen, cwd: Path) -> None:
    """Wait until the run's first checkpoint is published."""
    end = time.monotonic() + 180
    while not (cwd / "D" / "LATEST").exists():
        assert run.poll() is None and time.monotonic() < end, run.communicate()
        time.sleep(0.2)


def _until_checkpointed_again(run: subprocess.Popen, cwd: Path, latest: str) -> None:
    """Wait until the restarted coordinator publishes a checkpoint after ``latest``: the refusal and the SIGINT
    below then come while it runs, not while it starts (a fresh refusing process took as long as the restart)."""
    end = time.monotonic() + 180
    while (cwd / "D" / "LATEST").read_text() == latest:
        assert run.poll() is None and time.monotonic() < end, run.communicate()
        time.sleep(0.05)


def _refused(cwd: Path, run: subprocess.Popen, rounds: int, capfd) -> None:
    """A second run on the live checkpoint folder, into another --out (the same one is refused first, below), by
    fedpar's main in the test's process: its refusal's line and exit code are what it proves."""
    done = run_main(SIMULATE[3:-1] + ["O2", "--rounds", str(rounds)], capfd, cwd)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"fedpar simulate: --checkpoint-dir D is in use by another fedpar run (pid "
                                        f"{run.pid}); wait for it to end, or give another --checkpoint-dir"]


def test_a_second_run_on_a_live_checkpoint_folder_is_refused_across_the_coordinators_restart(tmp_path, capfd):
    run = _start(tmp_path)
    try:
        _until_checkpointed(run, tmp_path)
        _refused(tmp_path, run, 2000, capfd)
        _refused(tmp_path, run, 1, capfd)  # said 'nothing to train' and rewrote O/summary.json under the running run
        assert not (tmp_path / "O" / "summary.json").exists()
        before_kill = (tmp_path / "D" / "LATEST").read_text()
        os.kill(coordinator_child(run.pid), signal.SIGKILL)  # the launcher starts it again: it still holds the folder
        _until_checkpointed_again(run, tmp_path, before_kill)
        _refused(tmp_path, run, 2000, capfd)
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 130, err
    again = run_main(SIMULATE[3:] + ["--rounds", "1"], capfd, tmp_path)
    assert "in use" not in again.stderr and again.returncode == 0, again.stderr  # the lock went with the run


def test_a_second_run_into_a_live_runs_out_folder_is_refused(tmp_path, capfd):
    # QA: two runs into one --out both exited 0, and metrics.jsonl held rounds 1, 1, 2 from the two of them
    run = subprocess.Popen([sys.executable, "-m", "fedpar", "simulate", "--clients", "4", "--rounds", "2000", "--quiet",
                            "--out", "O"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 120
        while not (tmp_path / "O" / "metrics.jsonl").exists():
            assert run.poll() is None and time.monotonic() < end, run.communicate()
            time.sleep(0.1)
        done = run_main(["simulate", "--clients", "4", "--rounds", "1", "--quiet", "--out", "O"], capfd, tmp_path)
        assert done.returncode == 2 and done.stderr.splitlines() == [
            f"fedpar simulate: --out O is in use by another fedpar run (pid {run.pid}); wait for it to end, or give "
            "another --out"], done.stderr
        run.send_signal(signal.SIGINT)
        run.communicate(timeout=60)
    finally:
        run.kill()
    assert not (tmp_path / "O" / ".fedpar.lock").exists()  # the lock went with the run


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_coordinators_child_stops_the_run_as_one_to_its_launcher(signum, tmp_path):
    run = _start(tmp_path)
    try:
        _until_checkpointed(run, tmp_path)
        os.kill(coordinator_child(run.pid), signum)
        _, err = run.communicate(timeout=60)
    finally:
        run.kill()
    said = [line for line in err.splitlines() if line.startswith("fedpar simulate:")]
    assert run.returncode == 128 + signum, err
    assert len(said) == 1 and said[0].startswith("fedpar simulate: interrupted after "), err
    assert "Traceback" not in err and "interrupted: stopping" not in err, err
    assert (tmp_path / "O" / "summary.json").exists()


def test_a_ctrl_c_to_the_process_group_says_its_line_once(tmp_path):
    run = _start(tmp_path)
    try:
        _until_checkpointed(run, tmp_path)
        os.killpg(run.pid, signal.SIGINT)  # a terminal's Ctrl-C: the launcher and its child both get it
        _, err = run.communicate(timeout=60)
    finally:
        run.kill()
    said = [line for line in err.splitlines() if line.startswith("fedpar simulate:")]
    assert run.returncode == 130 and len(said) == 1 and said[0].startswith("fedpar simulate: interrupted after "), err


def test_a_refused_start_leaves_no_checkpoint_folder_it_made_for_its_lock(tmp_path, capfd):
    done = run_main(["simulate", "--clients", "6", "--clients-per-round", "1", "--secure-aggregation", "--rounds", "2",
                     "--quiet", "--checkpoint-dir", "NEW", "--out", "O"], capfd, tmp_path)
    assert done.returncode == 2 and "secure aggregation" in done.stderr, done.stderr
    assert not (tmp_path / "NEW").exists()
