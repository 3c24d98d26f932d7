"""SIGTERM (what systemd, Docker or a script sends) stops `fedpar train` as Ctrl-C does: one line on stderr, exit 128
+ the signal's number, summary.json with "interrupted": true and, on one process, the model of the last whole step
(QA: SIGTERM ended it at once with exit 143, no line, and only metrics.jsonl)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from fedpar.parallel.stopping import StopRequested, held_stops, stop_on_signals

FEDPAR = [sys.executable, "-m", "fedpar"]


def _stopped(args: list[str], out: Path, signum: int, tmp_path: Path) -> tuple[int, str]:
    """Start `fedpar ARGS --out OUT`, send ``signum`` once its first row is logged; its exit code and stderr."""
    err = tmp_path / f"{out.name}.err"
    with err.open("w") as stderr:
        proc = subprocess.Popen([*FEDPAR, *args, "--device", "cpu", "--no-plot", "--out", str(out)], cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=stderr, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            end = time.monotonic() + 120
            while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()):
                assert proc.poll() is None and time.monotonic() < end, err.read_text()
                time.sleep(0.05)
            proc.send_signal(signum)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return proc.returncode, err.read_text()


@pytest.mark.parametrize("signum,nproc", [(signal.SIGTERM, 1), (signal.SIGINT, 1), (signal.SIGTERM, 2)],
                         ids=["SIGTERM", "SIGINT", "SIGTERM-nproc2"])
def test_a_stop_signal_to_train_writes_the_summary_and_model_with_one_line(tmp_path, signum, nproc):
    out = tmp_path / "run"
    code, err = _stopped(["train", "--model", "mlp", "--dataset", "digits", "--max-steps", "100000", "--log-every",
                          "2", "--nproc", str(nproc)], out, signum, tmp_path)
    assert code == 128 + signum, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    steps = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True
    if nproc == 1:  # the model of the last whole step (several ranks are stopped without gathering theirs): its
        kept = json.loads((out / "global.json").read_text())  # step is the summary's, logged or not
        step = kept["metrics"]["step"]
        assert kept["interrupted"] is True and step >= steps[-1] >= 2 and summary["steps"] == step
        assert err.startswith(f"fedpar train: interrupted after {step} steps; wrote {out}/metrics.jsonl, metrics.csv, "
                              "summary.json, global.safetensors and global.json; nothing to resume from"), err
        assert load_file(out / "global.safetensors")
    else:
        assert summary["steps"] == steps[-1] >= 2
        assert err.startswith(f"fedpar train: interrupted after {steps[-1]} logged steps; wrote {out}/metrics.jsonl, "
                              "metrics.csv and summary.json; nothing to resume from"), err


def test_sigterm_to_train_task_says_it_was_interrupted_in_one_line_with_143(tmp_path):
    code, err = _stopped(["train", "--task", "fedpar.tasks.zoo:classifier", "--task-option", "model=mlp",
                          "--task-option", "dataset=digits", "--max-steps", "1000000"], tmp_path / "run",
                         signal.SIGTERM, tmp_path)
    assert code == 143, err
    assert err.strip() == ("fedpar train: interrupted; nothing to resume from (--checkpoint-every K keeps a "
                           "checkpoint at the end of an epoch after each K steps)"), err


def test_a_stop_signal_inside_held_stops_is_raised_at_its_end():
    finished = False
    with stop_on_signals() as received:
        with pytest.raises(StopRequested):
            with held_stops():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # the handler runs here, and holds the stop
                finished = True
    assert finished and received.signal == "SIGTERM"


def test_a_signal_an_inner_block_took_is_the_first_for_the_outer_one():
    with stop_on_signals() as outer:
        with pytest.raises(StopRequested):
            with stop_on_signals() as inner:  # a launcher's, inside a command's
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
        assert inner is outer and outer.signal == "SIGINT"  # another SIGINT now, a second later, exits at once


@pytest.mark.parametrize("task", [False, True], ids=["engine-nproc2", "task"])
def test_a_run_stopped_before_its_first_checkpoint_says_none_is_kept_yet_not_to_pass_checkpoint_every(tmp_path, task):
    # QA: a run given --checkpoint-every 5, stopped at step 2, said "(--checkpoint-every K keeps a checkpoint ...)"
    what = (["--task", "fedpar.tasks.zoo:classifier", "--task-option", "model=mlp", "--task-option", "dataset=digits"]
            if task else ["--model", "mlp", "--dataset", "digits", "--nproc", "2", "--log-every", "2"])
    code, err = _stopped(["train", *what, "--max-steps", "1000000", "--checkpoint-every", "1000000"],
                         tmp_path / "run", signal.SIGINT, tmp_path)
    assert code == 130 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    first = "at the end of the first epoch after 1000000 steps" if task else "at step 1000000"
    said = f"; nothing to resume from yet (--checkpoint-every 1000000 keeps the first {first})"
    assert err.strip().endswith(said), err
