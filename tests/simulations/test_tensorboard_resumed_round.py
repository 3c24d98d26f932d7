"""--tensorboard across a resume of `fedpar simulate --checkpoint-dir`: the round a run resumes after has one point,
also where the run died between that round's checkpoint and its metrics line (the resume repairs the line; its point
was missing, QA), and not two where the point was written before it died."""

from __future__ import annotations

import json
import shutil

import pytest

from support.in_process import run_main


def _points(tb) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("test_accuracy")]


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_round_a_simulation_resumes_after_has_one_tensorboard_point(tmp_path, capfd):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'fedpar[tensorboard]')")
    out, tb = tmp_path / "o", tmp_path / "tb"

    def simulate(rounds: int) -> None:
        done = run_main(["simulate", "--clients", "4", "--rounds", str(rounds), "--local-epochs", "1", "--quiet",
                         "--checkpoint-dir", "ck", "--out", "o", "--tensorboard", "tb"], capfd, cwd=tmp_path)
        assert done.returncode == 0, done.stderr

    simulate(2)
    simulate(3)  # resumes after round 2, whose point the first run wrote
    assert _points(tb) == [(r["round"], pytest.approx(r["test_accuracy"])) for r in _rows(out)]
    assert [step for step, _ in _points(tb)] == [1, 2, 3]
    # as a kill between round 3's checkpoint and its metrics line leaves them: no line, no point
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(lines[:-1]))
    shutil.rmtree(tb)  # (this run's earlier points go too: the repaired round's is the one looked for)
    simulate(4)
    rows = _rows(out)
    assert [r["round"] for r in rows] == [1, 2, 3, 4]  # round 3's line repaired from its checkpoint
    assert _points(tb) == [(r["round"], pytest.approx(r["test_accuracy"])) for r in rows[2:]]
