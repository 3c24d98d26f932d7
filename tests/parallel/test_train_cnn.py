"""`fedpar train` with the FedAvg paper's CNN under DDP on 2 ranks; only rank 0 speaks on the console."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)


def test_cnn_trains_under_ddp_and_only_rank_0_logs(tmp_path: Path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "fedpar", "train", "--model", "cnn", "--dataset", "digits",
                           "--epochs", "2", "--nproc", "2", "--device", "cpu", "--dp-replicate", "2", "--lr", "0.1",
                           "--log-every", "10",
                           "--no-plot", "--out", str(out)], capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["model"], summary["world_size"], summary["config"]["parallel"]["dp"]) == ("cnn", 2, 2)
    assert summary["steps"] == 2 * 23  # ceil(1437 / 64) batches per epoch, the same on both ranks
    assert summary["test_accuracy"] > 0.7  # ~0.9 after 2 epochs; chance is 0.1
    assert summary["model_state_bytes"][0] == summary["model_state_bytes"][1]  # DDP: full replicas
    # Spawned ranks share the console: a line printed by rank 1 too would appear twice.
    lines = proc.stdout.splitlines()
    assert sum("epoch 1 done" in line for line in lines) == 1
    assert sum(line.startswith("epoch 0 step 10/") for line in lines) == 1
    assert len([x for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]) == 2
