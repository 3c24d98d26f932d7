"""A `fedpar simulate` stopped (Ctrl-C, SIGTERM) before its first round keeps the outputs an earlier run left in its
--out (QA: a run into the folder of an earlier one, stopped while round 1 was open, left only its own summary.json of
0 rounds: the earlier run's model, rows and plots were gone)."""

from __future__ import annotations

import hashlib
import shutil
import signal
import subprocess
import sys

import pytest

from support.in_process import logging_as_a_fresh_process

ARGS = ["simulate", "--clients", "4", "--local-epochs", "1", "--out", "O"]
SIMULATE = [sys.executable, "-m", "fedpar", *ARGS]


def _files(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory):
    """The folder of an earlier run of 1 round (its O), made once by the command's main in this process: only the
    stopped run below is what the tests are about, and it is a process of its own."""
    base = tmp_path_factory.mktemp("earlier")
    with pytest.MonkeyPatch.context() as mp, logging_as_a_fresh_process():
        mp.chdir(base)
        from fedpar.cli.main import main

        assert main(ARGS + ["--rounds", "1", "--quiet"]) == 0
    return base / "O"


@pytest.mark.parametrize("stop, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_run_stopped_before_its_first_round_keeps_the_earlier_runs_outputs(tmp_path, earlier_run, stop, code):
    shutil.copytree(earlier_run, tmp_path / "O")
    before = _files(tmp_path / "O")
    assert {"metrics.jsonl", "global.safetensors", "summary.json", "accuracy.png"} <= set(before)
    # every member vanishes before it uploads: round 1 stays open until the signal
    run = subprocess.Popen(SIMULATE + ["--rounds", "2", "--seed", "3", "--drop-probability", "1", "--deadline", "300",
                                       "--quiet", "--log-level", "info"], cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        for line in run.stderr:
            if "round 1: sampled" in line:
                break
        run.send_signal(stop)
        out, err = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == code, err
    assert out.splitlines()[-1] == "wrote nothing to O", out
    assert _files(tmp_path / "O") == before
    assert not (tmp_path / "O" / ".earlier-run").exists()
