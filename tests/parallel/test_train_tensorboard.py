"""`fedpar train --tensorboard DIR`: the logged steps and evaluations read back from the event file, and
metrics.csv beside metrics.jsonl."""

from __future__ import annotations

import json

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
