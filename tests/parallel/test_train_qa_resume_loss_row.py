"""QA: a `fedpar train` run resumed from a checkpoint taken between two logged losses (--checkpoint-every not a
multiple of --log-every) logged, as its first row, the mean of only the steps it trained itself: at step 8 the mean
of steps 6-8 where an unbroken run logs that of 5-8. The checkpoint keeps the interval's loss, so the resumed run
logs the rows an unbroken one does."""

from __future__ import annotations

import json

import pytest

from support.in_process import run_main

pytestmark = pytest.mark.timeout(120)

RUN = ["train", "--model", "mlp", "--dataset", "digits", "--device", "cpu", "--log-every", "4", "--checkpoint-every",
       "5", "--no-plot"]


def _losses(out) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if row.get("kind") == "train"}


def test_a_run_resumed_between_two_logged_losses_logs_the_rows_of_an_unbroken_run(tmp_path, capfd):
    unbroken, resumed = tmp_path / "unbroken", tmp_path / "resumed"
    assert run_main([*RUN, "--max-steps", "16", "--out", str(unbroken)], capfd).returncode == 0
    assert run_main([*RUN, "--max-steps", "10", "--out", str(resumed)], capfd).returncode == 0
    # as a run that died at step 7 left it: its checkpoint of step 5 the latest, its rows up to step 4
    (resumed / "checkpoints" / "latest").write_text("step-00000005")
    metrics = resumed / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                               if json.loads(line).get("step", 0) <= 4))
    done = run_main([*RUN, "--max-steps", "16", "--out", str(resumed)], capfd)
    assert done.returncode == 0 and "resumed from" in done.stdout + done.stderr, done.stderr
    expected, got = _losses(unbroken), _losses(resumed)
    assert sorted(got) == sorted(expected) == [4, 8, 12, 16]
    assert got == pytest.approx(expected, rel=1e-9, abs=0), (got, expected)
