"""simulations/run_outputs.py's EarlierRun after a new run was killed (kill -9): the next run into the same --out
gets back the earlier run's files unless the killed run had set them all aside and written its own. Killed between
two of its moves, it had written nothing: the earlier files still in --out were taken for its own, and the ones
already moved aside were deleted."""

from __future__ import annotations

from pathlib import Path

from fedpar.simulations.run_outputs import EarlierRun, earlier_run_in
from support.earlier_run import earlier_run, file_digests


def _killed_after_moving(out: Path, names: tuple[str, ...]) -> None:
    """What a new run killed as it set the earlier run's files aside leaves: ``names`` moved, the rest in place."""
    aside = out / EarlierRun.FOLDER
    aside.mkdir()
    for name in names:
        (out / name).replace(aside / name)


def test_a_run_killed_between_two_moves_gives_every_earlier_file_back(tmp_path):
    out = tmp_path / "out"
    before = earlier_run(out)
    _killed_after_moving(out, ("metrics.jsonl", "metrics.csv"))  # the metrics first, then the model and summary
    assert earlier_run_in(out, resumes=True) is None  # what the next run, resuming or not, does first
    assert file_digests(out) == before and not (out / EarlierRun.FOLDER).exists()


def test_a_run_killed_after_its_first_row_lets_the_earlier_files_go(tmp_path):
    out = tmp_path / "out"
    earlier_run(out)
    new = EarlierRun(out)  # sets every file aside
    assert (out / EarlierRun.FOLDER / EarlierRun.DONE).is_file() and not list(out.glob("*.json*"))
    (out / "metrics.jsonl").write_text('{"step": 1}\n')  # its first row; then kill -9: no settle()
    del new
    EarlierRun.recover(out)
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_run_killed_before_its_first_row_gives_every_earlier_file_back(tmp_path):
    out = tmp_path / "out"
    before = earlier_run(out)
    EarlierRun(out)
    EarlierRun.recover(out)
    assert file_digests(out) == before and not (out / EarlierRun.FOLDER).exists()
