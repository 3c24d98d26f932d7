"""`fedpar train` on a terminal, stopped by Ctrl-C (SIGINT to the terminal's process group): its progress bar is taken
down and the cursor shown again before the line that says what completed. The bar stayed up, drawn again below that
line (one process) or with the line glued to it (--nproc 2, whose launcher ends the ranks), and the cursor stayed
hidden in the user's shell."""

from __future__ import annotations

import os
import pty
import select
import signal
import sys
import time
from pathlib import Path

import pytest

HIDE, SHOW = "\x1b[?25l", "\x1b[?25h"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _interrupted_on_a_terminal(argv: list[str], timeout: float = 240.0) -> tuple[str, int]:
    """What ``fedpar ARGV`` wrote to a terminal when Ctrl-C came once its bar was up, and its exit code."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: fedpar on the terminal, its session's foreground group
        os.execv(sys.executable, [sys.executable, "-m", "fedpar", *argv])
    out, sent, end = b"", False, time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            if not sent and HIDE.encode() in out and b"step " in out.split(HIDE.encode(), 1)[1]:
                os.killpg(pid, signal.SIGINT)  # the bar is up and a step line was printed above it
                sent = True
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # the terminal's other side closed: every process on it ended
                    break
                if not data:
                    break
                out += data
        else:
            raise AssertionError(f"no end in {timeout} s: {out[-2000:]!r}")
    finally:
        if not sent or time.monotonic() >= end:
            os.killpg(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return out.decode("utf-8", "replace"), os.waitstatus_to_exitcode(status)


ZOO = ["--model", "mlp", "--dataset", "digits", "--epochs", "400", "--log-every", "20"]
TASK = ["--task", f"{EXAMPLES}/own_task.py:task", "--task-option", f"csv={EXAMPLES}/table.csv", "--epochs", "5000"]


@pytest.mark.parametrize("trained, nproc", [(ZOO, "1"), (ZOO, "2"), (TASK, "1"), (TASK, "2")],
                         ids=["zoo", "zoo-nproc-2", "task", "task-nproc-2"])
def test_ctrl_c_takes_the_bar_down_and_shows_the_cursor_before_the_last_line(tmp_path, trained, nproc):
    text, code = _interrupted_on_a_terminal(["train", *trained, "--no-plot", "--nproc", nproc, "--device", "cpu",
                                             "--out", str(tmp_path / "out")])
    assert code == 130, text[-2000:]
    before, said = text.rsplit("fedpar train: interrupted", 1)
    assert text.count(HIDE) == text.count(SHOW) >= 1, text[-2000:]  # the cursor is shown again
    assert before.endswith(("\n", "\x1b[2K", "\x1b[2K" + SHOW)), before[-300:]  # the line starts clean
    assert "\u2501" not in said, said  # and no bar (drawn with ━) below it
