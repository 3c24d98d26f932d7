"""A launcher's stop that reaches a forked rank before the rank has set up its own signals (a child not yet given the
CPU on a loaded machine): the rank ends by it, as one that had, and its launcher can tell it said nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# The rank stops itself as the fork returns, holding its launcher's signal handlers: the test then has the launcher
# stopped, sees the launcher's SIGTERM wait on the stopped rank, and lets the rank go on.
LAUNCHER = """
import os, signal, sys, time
from pathlib import Path
from fedpar.parallel.init import LaunchStopped, spawn

def rank_ran(path):
    Path(path).write_text("ran")
    time.sleep(60)

if __name__ == "__main__":
    os.register_at_fork(after_in_child=lambda: os.kill(os.getpid(), signal.SIGSTOP))
    try:
        spawn(1, rank_ran, sys.argv[1], parent_stops=True, start_method="fork", stop_grace=30.0)
    except LaunchStopped as exc:
        print(f"rank 0 said nothing: {exc.rank_0_said_nothing}", flush=True)
"""


def _child(pid: int) -> int | None:
    found = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(found[0]) if found else None


def _stat(pid: int, field: str) -> str:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next(line.split(":", 1)[1].strip() for line in lines if line.startswith(field + ":"))


def _wait(condition, what: str, seconds: float = 60.0) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, f"no {what} in {seconds} s"
        time.sleep(0.01)


def test_a_rank_stopped_before_its_own_signals_ends_by_the_stop_and_the_launcher_says_for_it(tmp_path):
    ran = tmp_path / "ran"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(ran)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: _child(launcher.pid) is not None, "forked rank")
        rank = _child(launcher.pid)
        _wait(lambda: _stat(rank, "State").startswith("T"), "rank stopped as it forked")
        launcher.send_signal(signal.SIGINT)
        # the launcher's SIGTERM waits on the stopped rank (pending: SigPnd for the thread, ShdPnd for the process)
        _wait(lambda: int(_stat(rank, "ShdPnd"), 16) & (1 << (signal.SIGTERM - 1)), "SIGTERM pending on the rank")
        os.kill(rank, signal.SIGCONT)
        resumed = time.monotonic()
        out, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    # it ended by the SIGTERM within the launcher's grace, before running anything of its own, and said nothing
    assert time.monotonic() - resumed < 20, out
    assert not ran.exists(), out
    assert "rank 0 said nothing: True" in out and "Traceback" not in out, out
