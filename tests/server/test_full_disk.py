"""A real `fedpar serve --checkpoint-dir` whose disk fills up, or whose checkpoint folder is made read-only, in the
middle of a run: it stops with one line naming the folder and what to do, exit 1 and no traceback; the checkpoint
before stays loadable, and the same command, once the folder can be written again, resumes from it and finishes
(with one rank, and with two: rank 0 says the line, and the launcher adds none).

A full disk is a file-size limit set on the running process (prlimit; writes beyond it fail with EFBIG, as they
would with ENOSPC, for this process only). Real agents (client.agent.Agent on digits) run in threads here.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedpar.server.checkpoint import load_checkpoint
from support.devices import RANKS_ON_CPU
from support.digit_agents import start_digit_agents
from support.ports import free_port_run
from support.processes import DROP_ROOT_OVERRIDES

ROOT = Path(__file__).resolve().parents[2]
FAULT_AFTER = 2  # a fault once 2 rounds (of the first command, or of a resumed one) are checkpointed
FLAGS = ["--insecure", "--min-available", "2", "--clients-per-round", "2",
         "--overselect", "1.0", "--deadline", "30", "--seed", "3", "--heartbeat", "1", "--liveness-timeout", "10",
         "--local-epochs", "1", "--batch-size", "32", "--no-central-eval"]


def _serve(tmp: Path, port: int, ranks: int, rounds: int) -> subprocess.Popen:
    cmd = [sys.executable, "-c", DROP_ROOT_OVERRIDES, sys.executable, "-m", "fedpar.cli.main", "serve", "--port",
           str(port), "--port-file", str(tmp / "port"), "--checkpoint-dir", str(tmp / "ckpt"), "--out",
           str(tmp / "out"), "--aggregator-ranks", str(ranks), "--rounds", str(rounds), *RANKS_ON_CPU, *FLAGS]
    # Pipes, not files: a file-size limit on the process would cut its own log short too.
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _latest(ckpt: Path) -> str:
    try:
        return (ckpt / "LATEST").read_text().strip()
    except FileNotFoundError:
        return ""


def _wait_for(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.02)
    raise TimeoutError(what)


def _fill_disk(pid: int, ckpt: Path) -> None:
    # Above what metrics.jsonl and state.json reach in the rounds of a test, below the model's file (38 KiB).
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (16 << 10, resource.RLIM_INFINITY))


def _make_read_only(pid: int, ckpt: Path) -> None:
    ckpt.chmod(0o555)


@pytest.mark.parametrize("faults, ranks",
                         [(((_fill_disk, "File too large"), (_make_read_only, "Permission denied")), 1),
                          (((_make_read_only, "Permission denied"),), 2)],
                         ids=["full-disk-then-read-only-folder", "read-only-folder-2-ranks"])
def test_an_unwritable_checkpoint_stops_the_run_in_one_line_and_the_same_command_resumes(tmp_path, faults, ranks):
    """Each fault stops the run in one line, exit 1, the checkpoint before kept; the same command resumes from it (on
    one rank: a full disk, then, in the resumed command, a read-only folder; on two: a read-only folder) and
    finishes."""
    ckpt = tmp_path / "ckpt"
    rounds = FAULT_AFTER * len(faults) + 3  # room for a fault to land 3 rounds late
    # Rank r listens on port + r, in the first run and again in the resumed one: ports free as a run, not just one.
    server = _serve(tmp_path, free_port_run(ranks), ranks, rounds)
    agents, kept = [], None
    try:
        _wait_for(lambda: (tmp_path / "port").exists() or server.poll() is not None, 60, "serve did not start")
        port = int((tmp_path / "port").read_text())
        agents, threads, errors = start_digit_agents(port, ["ag0", "ag1"], give_up_after=60)
        for fault, said in faults:
            resumed_after = None if kept is None else kept.round_id
            fault_after = FAULT_AFTER + (resumed_after or 0)
            _wait_for(lambda: _latest(ckpt) >= f"round-{fault_after:06d}" or server.poll() is not None, 60,
                      f"round {fault_after} was never checkpointed")
            fault(server.pid, ckpt)
            out, err = server.communicate(timeout=60)
            ckpt.chmod(0o755)
            assert server.returncode == 1, (out, err)
            assert "Traceback" not in err, err
            if resumed_after is not None:  # this command was the same command again: it had resumed
                assert f"resumed from checkpoint after round {resumed_after}" in err, err
            lines = [line for line in err.splitlines() if line.startswith("fedpar serve:")]
            assert len(lines) == 1 and " ERROR " not in err, err  # and the log said nothing of it before
            kept = load_checkpoint(ckpt)  # the checkpoint before the failure is whole
            assert fault_after <= kept.round_id < rounds
            assert lines[0].startswith(f"fedpar serve: {said}: round-{kept.round_id + 1:06d} in folder {ckpt}; "), err
            assert lines[0].endswith(f"; round-{kept.round_id:06d} is kept; run the same command again to resume "
                                     "from it" + (" (--debug shows the traceback)" if ranks == 1 else "")), err
            left = [p.name for p in ckpt.iterdir() if p.name.startswith(".")]
            if fault is _fill_disk:
                assert not left  # no part of a checkpoint left
            else:  # a checkpoint being staged as the folder turned read-only stays until the folder can be written
                assert len(left) <= 1 and all(n == f".round-{kept.round_id + 1:06d}.partial" for n in left), left

            assert not errors and all(t.is_alive() for t in threads), errors  # the agents wait for the coordinator
            server = _serve(tmp_path, port, ranks, rounds)  # the same command (on the same port, which the agents dial)
        out, err = server.communicate(timeout=120)
        assert server.returncode == 0, err
        assert f"resumed from checkpoint after round {kept.round_id}" in err
        assert _latest(ckpt) == f"round-{rounds:06d}"
        assert not [p.name for p in ckpt.iterdir() if p.name.startswith(".")]  # the resumed run cleared any leftover
        rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == list(range(1, rounds + 1))
        assert not errors, errors
    finally:
        ckpt.chmod(0o755) if ckpt.exists() else None
        if server.poll() is None:
            server.kill()
            server.communicate()
        for a in agents:
            a.stop()
