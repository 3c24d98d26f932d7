"""`fedpar simulate --flower-app DIR` into the --out of an earlier run keeps that run's outputs until it writes a
round, as plain `fedpar simulate` does (simulations/run_outputs.py's EarlierRun): a ServerApp that fails, or a Ctrl-C,
before its first round leaves them as they were (QA: it cleared them at start, and a run that wrote no round left
nothing of either run)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from support.earlier_run import earlier_run, file_digests  # noqa: E402
from support.in_process import run_main  # noqa: E402

APP = Path(__file__).parent / "tiny_app"


def test_a_server_app_that_fails_before_a_round_keeps_the_earlier_runs_outputs(tmp_path, capfd):
    out = tmp_path / "out"
    before = earlier_run(out)
    done = run_main(["simulate", "--flower-app", str(APP), "--run-config", "send-nothing=true", "--clients", "2",
                     "--workers", "1", "--out", str(out)], capfd)
    assert done.returncode == 1 and "no round ran" in done.stderr, done.stderr[-3000:]
    assert file_digests(out) == before
    assert not (out / ".earlier-run").exists()


def test_a_run_that_writes_a_round_replaces_every_file_of_theearlier_run(tmp_path, capfd):
    out = tmp_path / "out"
    earlier_run(out)
    done = run_main(["simulate", "--flower-app", str(APP), "--run-config", "num-server-rounds=1", "--clients", "2",
                     "--workers", "1", "--quiet", "--out", str(out)], capfd)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (out / "labels.png").exists() and not (out / ".earlier-run").exists()  # the earlier run's only
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["message_type"] for r in rows] == ["train", "evaluate"]
    assert json.loads((out / "summary.json").read_text())["rounds"] == 2
    assert done.stdout.splitlines()[-1].startswith(f"wrote {out}/metrics.jsonl"), done.stdout


def test_a_run_stopped_before_its_first_round_keeps_the_earlier_runs_outputs_and_says_it_wrote_nothing(tmp_path):
    out = tmp_path / "out"
    before = earlier_run(out)
    run = subprocess.Popen([sys.executable, "-m", "fedpar", "simulate", "--flower-app", str(APP), "--run-config",
                            "train-seconds=120", "--clients", "2", "--workers", "1", "--quiet", "--log-level", "info",
                            "--out", str(out)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        for line in run.stderr:  # round 1 stays open while the ClientApps sleep
            if "round 1: 2 Flower 'train' messages" in line:
                break
        run.send_signal(signal.SIGINT)
        stdout, stderr = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 130, stderr[-3000:]
    assert stdout.splitlines()[-1] == f"wrote nothing to {out}", stdout
    assert file_digests(out) == before
    assert not (out / ".earlier-run").exists()
