"""``--task-option KEY=VALUE`` beside ``--flower-app``, a Flower user's run-config override given the wrong way: every
command refuses it in one line naming ``--run-config``, before any coordinator listens or agent dials."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")

APP = Path(__file__).parent / "tiny_app"
SAID = "--task-option needs --task; a Flower App's run config is overridden with --run-config 'KEY=VALUE ...'"


@pytest.mark.parametrize("command", [
    ["simulate", "--clients", "2", "--workers", "1"],
    ["serve", "--insecure", "--port", "0", "--min-available", "2"],
    ["serve", "--insecure", "--port", "0", "--min-available", "2", "--strategy", "fedavg"],
    ["client", "--insecure", "--server", "127.0.0.1:1", "--agent-id", "a", "--partition-index", "0",
     "--num-partitions", "2"],
], ids=["simulate", "serve-server-app", "serve-strategy", "client"])
def test_a_task_option_beside_a_flower_app_is_refused_in_one_line(tmp_path, command):
    """serve and client ignored it: the coordinator listened and ran the app with its own lr, the agent dialled; simulate
    said only '--task-option needs --task' (QA)."""
    done = subprocess.run([sys.executable, "-m", "fedpar", *command, "--flower-app", str(APP), "--task-option",
                           "lr=0.5", "--out", str(tmp_path / "out")] if command[0] != "client" else
                          [sys.executable, "-m", "fedpar", *command, "--flower-app", str(APP), "--task-option",
                           "lr=0.5"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    lines = [line for line in done.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1] == f"fedpar {command[0]}: {SAID}", done.stderr[-3000:]
    assert "listening" not in done.stderr + done.stdout and "dialing" not in done.stderr + done.stdout
