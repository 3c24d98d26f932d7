"""examples/in_python.py interrupted (Ctrl-C) mid-run exits: its agents stop with the coordinator, and no upload
retry outlives them (QA: the process stayed alive for good)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The example's own run(), many rounds; each round's end said on stdout so the test interrupts a run under way.
SCRIPT = textwrap.dedent("""
    import runpy
    from fedpar.server.app import CoordinatorServer

    start = CoordinatorServer.start

    def start_saying_rounds(self):
        self.coordinator.on_round_end.append(lambda row: print("ROUND", row["round"], flush=True))
        return start(self)

    CoordinatorServer.start = start_saying_rounds
    runpy.run_path({example!r})["run"](rounds=100000, agents=3)
""")


def test_ctrl_c_mid_run_exits_within_seconds(tmp_path):
    script = tmp_path / "long_run.py"
    script.write_text(SCRIPT.format(example=str(ROOT / "examples" / "in_python.py")))
    proc = subprocess.Popen([sys.executable, "-u", str(script)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        seen = []
        for line in proc.stdout:  # until the first round ended
            seen.append(line)
            if line.startswith("ROUND"):
                break
        assert proc.poll() is None, "".join(seen)
        proc.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        rest = proc.communicate(timeout=30)[0]
        took = time.monotonic() - interrupted
        assert took < 10, f"exited {took:.1f}s after SIGINT"
        assert "KeyboardInterrupt" in rest
        assert "Exception in thread" not in rest, rest  # no agent's thread ends in a traceback
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
