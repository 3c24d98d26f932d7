"""A Ctrl-C of `fedpar simulate` during a secure round is said once, by the command (QA: the runner's log warning
'interrupted: stopping after 0 completed rounds' came before the command's own line)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time


def test_a_ctrl_c_during_a_secure_round_is_said_once(tmp_path):
    run = subprocess.Popen([sys.executable, "-m", "fedpar", "simulate", "--clients", "6", "--clients-per-round", "4",
                            "--rounds", "5000", "--secure-aggregation", "--quiet", "--out", "O"], cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 180
        while not (tmp_path / "O" / "metrics.jsonl").exists():  # rounds are under way
            assert run.poll() is None and time.monotonic() < end, run.communicate()
            time.sleep(0.2)
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=60)
    finally:
        run.kill()
    said = [line for line in err.splitlines() if "interrupted" in line]
    assert run.returncode == 130 and len(said) == 1, err
    assert said[0].startswith("fedpar simulate: interrupted after "), err
