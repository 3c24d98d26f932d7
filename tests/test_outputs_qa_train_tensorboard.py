"""`fedpar train --tensorboard DIR` read back as a user analysing it does, with TensorBoard's EventAccumulator: one
point per tag and step, also at a step that is both logged and evaluated (an epoch's last step, and the run's last
step, always logged), where the train line and the evaluation both carry the epoch."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from support.in_process import run_main


def test_every_tag_has_one_point_per_step_where_a_logged_step_is_also_evaluated(tmp_path, capfd):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'fedpar[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, tb = tmp_path / "run", tmp_path / "tb"
    # digits: 23 steps of 64 an epoch; --log-every 23 logs the train line of steps 23 and 46, both evaluated too
    done = run_main(["train", "--model", "mlp", "--dataset", "digits", "--epochs", "2", "--log-every", "23",
                     "--no-plot", "--out", str(out), "--tensorboard", str(tb)], capfd)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [("train", 23), ("eval", 23), ("train", 46), ("eval", 46)]
    events = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"epoch", "loss", "test_accuracy"} <= set(tags)
    repeated = {tag: [step for step, n in Counter(e.step for e in events.Scalars(tag)).items() if n > 1]
                for tag in tags}
    assert not any(repeated.values()), repeated
    assert [(e.step, e.value) for e in events.Scalars("epoch")] == [(23, 0), (46, 1)]
