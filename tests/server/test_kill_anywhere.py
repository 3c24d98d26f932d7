"""`kill -9` of the coordinator at seeded random moments (mid-round, mid-checkpoint, between rounds, during
start-up): every restart resumes, and the run ends with every round exactly once and a loadable checkpoint.

The coordinator is `tests/support/synthetic_coordinator.py` (the real Coordinator and gRPC server, a 2M
parameter model so each checkpoint takes a while to write); the clients are members of one client runtime
(tests/support/synthetic_members.py), which re-joins by itself.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedpar.server.checkpoint import load_checkpoint
from support.processes import port_in_file

ROOT = Path(__file__).resolve().parents[2]
MEMBERS = ROOT / "tests" / "support" / "synthetic_members.py"
COORDINATOR = ROOT / "tests" / "support" / "synthetic_coordinator.py"
ROUNDS, AGENTS, KILLS = 10, 6, 3
SEED = int(os.environ.get("FEDPAR_KILL_SEED", "20261122"))


def _rows(path: Path, strict: bool = True) -> list[dict]:
    """The metrics lines; not ``strict``: skip a line torn by a kill (the restarted coordinator repairs it)."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if strict:
                raise
    return rows


def _start(tmp: Path, port: int) -> subprocess.Popen:
    (tmp / "port").unlink(missing_ok=True)
    return subprocess.Popen(
        [sys.executable, str(COORDINATOR), "--params", "2000000", "--agents",
         str(AGENTS), "--rounds", str(ROUNDS), "--deadline", "60", "--port", str(port), "--port-file",
         str(tmp / "port"), "--checkpoint-dir", str(tmp / "ckpt"), "--metrics", str(tmp / "metrics.jsonl"),
         "--linger", "2"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
        stderr=open(tmp / "coordinator.log", "a"))


def _port(tmp: Path, proc: subprocess.Popen) -> int:
    return port_in_file(tmp / "port", proc, tmp / "coordinator.log")


@pytest.mark.timeout(240)
def test_kill_9_at_random_moments_loses_no_round(tmp_path):
    rng = random.Random(SEED)
    proc = _start(tmp_path, 0)
    port = _port(tmp_path, proc)
    members = subprocess.Popen([sys.executable, str(MEMBERS), "--server", f"127.0.0.1:{port}", "--count", str(AGENTS),
                                "--params", "2000000", "--poll", "2", "--max-backoff", "0.3"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=open(tmp_path / "members.log", "w"), text=True)
    kills = []
    try:
        for _ in range(KILLS):
            started = time.monotonic()
            time.sleep(rng.uniform(0.0, 1.5))  # re-joins, rounds, checkpoints and the linger all take part of this
            if proc.poll() is not None:
                break  # the run finished before this kill
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            kills.append((round(time.monotonic() - started, 2), len(_rows(tmp_path / "metrics.jsonl", False))))
            proc = _start(tmp_path, port)  # same port and checkpoint directory
            _port(tmp_path, proc)
        out = members.communicate(timeout=180)[0]
        try:
            stats = json.loads(out)
        except json.JSONDecodeError:
            raise AssertionError(f"the members' runtime exited {members.returncode} without its stats; "
                                 f"stdout {out[-1000:]!r}; "
                                 f"stderr: {(tmp_path / 'members.log').read_text()[-3000:]}") from None
        assert proc.wait(60) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    finally:
        for p in (proc, members):
            if p.poll() is None:
                p.kill()
    try:
        rows = _rows(tmp_path / "metrics.jsonl")
    except json.JSONDecodeError:
        raise AssertionError(f"torn metrics line left after kills {kills}:\n"
                             f"{(tmp_path / 'metrics.jsonl').read_text()[-2000:]}") from None
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1)), (kills, [r["round"] for r in rows])
    assert all(r["status"] == "ok" and r["reported"] == AGENTS for r in rows), rows
    print(f"\nkills (seconds after the coordinator listened, rounds done): {kills}")
    assert any(done < ROUNDS for _, done in kills), kills  # at least one kill cut the run short
    ckpt = load_checkpoint(tmp_path / "ckpt")
    assert ckpt.round_id == ROUNDS and ckpt.state["metrics_row"]["round"] == ROUNDS
    assert stats["finished"] == AGENTS and stats["accepted"] >= AGENTS * ROUNDS
