"""QA: a SIGHUP sent to `fedpar simulate`'s coordinator child alone (its pid, found by pgrep) was ignored, since the
child ignores a hangup (it reaches the whole process group, and the launcher stops the child), while a SIGINT to the
child alone is told to the launcher. A SIGHUP is now told the same way, with a word of its own: the run stops as for
a SIGHUP to the launcher (what completed written, one line, exit 129), and a closed terminal's hangup to the whole
group still says its line once. Real processes (cli/simulate.py _tell_launcher, _stops_told)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.processes import coordinator_child

pytestmark = pytest.mark.timeout(300)

SIMULATE = [sys.executable, "-m", "fedpar", "simulate", "--clients", "20", "--clients-per-round", "4", "--quiet",
            "--checkpoint-dir", "D", "--out", "O", "--rounds", "2000"]


def _start(cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(SIMULATE, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _until_checkpointed(run: subprocess.Popen, cwd: Path) -> None:
    end = time.monotonic() + 180
    while not (cwd / "D" / "LATEST").exists():
        assert run.poll() is None and time.monotonic() < end, run.communicate()
        time.sleep(0.2)


@pytest.mark.parametrize("to_group", [False, True], ids=["child-alone", "whole-group"])
def test_a_sighup_to_the_coordinators_child_stops_the_run_as_one_to_its_launcher(to_group, tmp_path):
    run = _start(tmp_path)
    try:
        _until_checkpointed(run, tmp_path)
        if to_group:  # a closed terminal: the launcher and its child both get it
            os.killpg(run.pid, signal.SIGHUP)
        else:
            os.kill(coordinator_child(run.pid), signal.SIGHUP)
        _, err = run.communicate(timeout=90)
    finally:
        run.kill()
    said = [line for line in err.splitlines() if line.startswith("fedpar simulate:")]
    assert run.returncode == 128 + signal.SIGHUP, err
    assert len(said) == 1 and said[0].startswith("fedpar simulate: interrupted after "), err
    assert "Traceback" not in err and "interrupted: stopping" not in err, err
    assert (tmp_path / "O" / "summary.json").exists()
