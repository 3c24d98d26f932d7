"""A Ctrl-C that reaches `fedpar simulate --checkpoint-dir` just after its coordinator process died (kill -9, a
crash), before the launcher started it again: the run stopped with exit 130 and said nothing at all (QA, 8 of 8
tries): the coordinator that would have said what completed was gone. The launcher says it was interrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from support.processes import started, stop_processes


def test_a_ctrl_c_just_after_the_coordinator_died_is_said(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "fedpar", "simulate", "--clients", "20", "--clients-per-round",
                             "4", "--quiet", "--checkpoint-dir", "ck", "--out", "o", "--rounds", "2000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            start_new_session=True)
    try:
        end = time.monotonic() + 120
        while not (tmp_path / "ck" / "LATEST").exists():  # a round checkpointed: the run would resume
            assert proc.poll() is None and time.monotonic() < end, proc.communicate()
            time.sleep(0.05)
        os.kill(started(proc.pid)[0], signal.SIGKILL)  # the coordinator (rank 0), as a crash ends it
        proc.send_signal(signal.SIGINT)  # at once: before the launcher sees it gone and starts it again
        out, err = proc.communicate(timeout=120)
    finally:
        stop_processes(proc)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1:] == ["fedpar simulate: interrupted"], err
