"""`fedpar simulate --checkpoint-dir` run again once every round is done: it says so in one line and exits 0 at once,
starting no process (no coordinator child, no worker: they used to start, join and be told training was over, and
the outputs were written again); into another --out it still writes the run's outputs there from the checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedpar.cli.main import main
from fedpar.server.checkpoint import LOCK
from support.in_process import logging_as_a_fresh_process
from support.processes import children

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["simulate", "--dataset", "digits", "--clients", "4", "--clients-per-round", "2", "--local-epochs", "1",
        "--seed", "7", "--workers", "1", "--seats", "1", "--quiet"]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A real run of 2 rounds on 4 clients, with its checkpoints and its outputs."""
    base = tmp_path_factory.mktemp("made")
    with pytest.MonkeyPatch.context() as mp, logging_as_a_fresh_process():
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.chdir(ROOT)
        assert main([*ARGS, "--rounds", "2", "--out", str(base / "out"), "--checkpoint-dir", str(base / "ckpt")]) == 0
    return base


@pytest.fixture
def run(made, tmp_path) -> Path:
    """A copy of the run, to resume."""
    shutil.copytree(made, tmp_path / "run")
    return tmp_path / "run"


def _files(*folders: Path) -> dict[str, tuple[bytes, int]]:
    """Each file's bytes and modification time (but the checkpoint folder's lock file's: each run holds it)."""
    return {str(p): (p.read_bytes(), p.stat().st_mtime_ns) for folder in folders for p in sorted(folder.iterdir())
            if p.is_file() and p.name != LOCK}


def _python(pid: int) -> bool:
    """Whether process ``pid`` runs Python (a coordinator's or a worker's process), not a tool that a library runs
    for a moment (ldconfig, uname); False once it is gone."""
    try:
        program = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0", 1)[0]
    except OSError:
        return False
    return "python" in Path(program.decode(errors="replace")).name


def _simulate(*argv: str) -> tuple[subprocess.CompletedProcess, set[int]]:
    """`fedpar simulate ARGV --log-level info` as a process: what it printed, and the processes it started (its
    Python children that live on at two looks 10 ms apart)."""
    proc = subprocess.Popen([sys.executable, "-m", "fedpar.cli.main", *argv, "--log-level", "info"], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    last: set[int] = set()
    try:
        while proc.poll() is None:
            now = {pid for pid in children(proc.pid) if _python(pid)}
            seen |= now & last  # alive at two looks: not a fork on its way to exec a tool
            last = now
            time.sleep(0.01)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), seen


@pytest.mark.parametrize("rounds, changed", [(2, []), (1, []), (2, ["--lr", "0.05", "--slow-fraction", "0.5"])])
def test_every_round_done_says_so_and_starts_no_process(run, rounds, changed):
    """Settings a resume may change, changed, are not said: no round trains with them (QA: 'resuming the checkpoint
    ... with --lr 0.05; its last session went with --lr 0.1' came before 'nothing to train')."""
    before = _files(run / "out", run / "ckpt")
    done, started = _simulate(*ARGS, "--rounds", str(rounds), "--out", str(run / "out"), "--checkpoint-dir",
                              str(run / "ckpt"), *changed)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        f"fedpar simulate: the checkpoint in {run / 'ckpt'} has every round done already (round 2, --rounds {rounds}): "
        f"nothing to train (its outputs are in {run / 'out'} already); give --rounds above 2 to train on, or another "
        "--checkpoint-dir to start afresh"], done.stderr  # no worker's, coordinator's or seat's line (--log-level info)
    assert done.stdout == "" and not started, (done.stdout, started)
    # the run's outputs and its record (each process that runs adds its seconds to run.json) are as they were
    assert _files(run / "out", run / "ckpt") == before


def test_every_round_done_into_another_out_writes_the_outputs_from_the_checkpoint(run):
    done, started = _simulate(*ARGS, "--rounds", "2", "--out", str(run / "other"), "--checkpoint-dir",
                              str(run / "ckpt"))
    assert done.returncode == 0 and started, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("fedpar simulate:")]
    assert said == [f"fedpar simulate: the checkpoint in {run / 'ckpt'} has every round done already (round 2, "
                    "--rounds 2): nothing to train; give --rounds above 2 to train on, or another --checkpoint-dir to "
                    "start afresh"], done.stderr
    assert json.loads((run / "other" / "global.json").read_text())["round"] == 2
    assert json.loads((run / "other" / "summary.json").read_text())["rounds"] == 2
