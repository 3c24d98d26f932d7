"""One-shot `fedpar serve` counts the agents it waits for in words that agree with the number: it said "waiting for 1
agents". A real serve process on loopback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_serve_waiting_for_one_agent_says_agent(tmp_path):
    serve = subprocess.Popen([sys.executable, "-m", "fedpar", "serve", "--insecure", "--host", "127.0.0.1", "--port",
                              "0", "--model", "synthetic", "--params", "1000", "--rounds", "1", "--min-available", "1",
                              "--out", str(tmp_path / "out")], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        line = next(line for line in serve.stdout if "coordinator listening" in line)
    finally:
        serve.kill()
        serve.wait()
        serve.stdout.close()
    assert "; waiting for 1 agent (start them with: fedpar client --server 127.0.0.1:" in line, line
