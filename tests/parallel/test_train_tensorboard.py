"""`fedpar train --tensorboard DIR`: the logged steps and evaluations read back from the event file, and
metrics.csv beside metrics.jsonl."""

from __future__ import annotations

import json
import shutil

import pytest

from fedpar.cli.main import main


def test_train_writes_its_steps_as_tensorboard_scalars_and_csv(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'fedpar[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, tb = tmp_path / "run", tmp_path / "tb"
    assert main(["train", "--model", "mlp", "--dataset", "digits", "--max-steps", "20", "--log-every", "10",
                 "--no-plot", "--out", str(out), "--tensorboard", str(tb)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tb))
    events.Reload()
    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(s, pytest.approx(v)) for s, v in train]
    assert [e.step for e in events.Scalars("test_accuracy")] == [r["step"] for r in records if r["kind"] == "eval"]
    lines = (out / "metrics.csv").read_text().splitlines()
    assert lines[0].startswith("kind,step,") and len(lines) == len(records) + 1


def test_a_resumed_train_replaces_the_interrupted_runs_tensorboard_steps_as_its_metrics_jsonl_does(tmp_path):
    # A run killed after logging steps 25 and 30 but before its step-30 checkpoint resumes from step 20: metrics.jsonl
    # dropped the two lines, but TensorBoard kept the killed run's steps 25 and 30 beside the resumed run's (two
    # points per step, the stale ones first).
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'fedpar[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, tb = tmp_path / "run", tmp_path / "tb"
    common = ["train", "--model", "mlp", "--dataset", "digits", "--log-every", "5", "--checkpoint-every", "20",
              "--no-plot", "--out", str(out), "--tensorboard", str(tb)]
    assert main([*common, "--max-steps", "30"]) == 0
    checkpoints = out / "checkpoints"  # as a kill between step 30's log line and its checkpoint leaves them
    shutil.rmtree(checkpoints / "step-00000030")
    (checkpoints / "latest").write_text("step-00000020")
    assert main([*common, "--max-steps", "40", "--lr", "0.2"]) == 0  # another lr: the steps after 20 differ
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tb))
    events.Reload()
    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    assert [s for s, _ in train] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(s, pytest.approx(v)) for s, v in train]
    assert [e.step for e in events.Scalars("test_accuracy")] == [r["step"] for r in records if r["kind"] == "eval"]
