"""`fedpar train` keeps the newest checkpoints of the run that writes them: a run started afresh (--no-resume) over an
earlier, longer run's checkpoints removes those once its own first one is `latest` (they were kept by step number,
and the fresh run's own were removed: `latest` named a folder that was gone and the next resume was refused), and
`latest` always names a complete checkpoint that exists."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fedpar.cli.main import main
from fedpar.parallel.checkpoint import latest_checkpoint
from fedpar.parallel.epoch_checkpoint import latest_epoch_checkpoint


def _train(out: Path, steps: int, *extra: str) -> list[str]:
    return ["train", "--model", "mlp", "--dataset", "digits", "--device", "cpu", "--batch-size", "64",
            "--max-steps", str(steps), "--checkpoint-every", "10", "--no-plot", "--out", str(out), *extra]


def _kept(out: Path) -> tuple[list[str], str]:
    """The checkpoint folders in OUT/checkpoints, and the one `latest` names (a complete one that exists)."""
    directory = out / "checkpoints"
    epochs = (directory / "latest").read_text().startswith("epoch-")
    latest = latest_epoch_checkpoint(directory, "afresh") if epochs else latest_checkpoint(directory)
    assert latest is not None and latest.is_dir()
    return sorted(p.name for p in directory.iterdir() if p.is_dir()), latest.name


@pytest.fixture(autouse=True)
def _one_rank(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_a_fresh_run_removes_an_earlier_runs_step_checkpoints_and_is_resumed(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_train(out, 40)) == 0
    assert _kept(out) == (["step-00000030", "step-00000040"], "step-00000040")
    capsys.readouterr()
    assert main(_train(out, 20, "--no-resume")) == 0
    assert _kept(out) == (["step-00000010", "step-00000020"], "step-00000020")
    said = capsys.readouterr().out
    assert (f"removed 2 checkpoint(s) of an earlier run in {out / 'checkpoints'}: step-00000030, step-00000040 "
            "(this run's step-00000010 is latest)") in said
    assert main(_train(out, 30)) == 0  # resumed from the fresh run's last checkpoint (was refused: exit 2)
    assert "resumed from" in capsys.readouterr().out
    assert _kept(out) == (["step-00000020", "step-00000030"], "step-00000030")


def test_a_crash_before_the_earlier_runs_checkpoints_are_removed_leaves_a_resumable_folder(tmp_path, capsys):
    out, earlier = tmp_path / "run", tmp_path / "earlier"
    assert main(_train(out, 40)) == 0
    shutil.copytree(out / "checkpoints", earlier)
    assert main(_train(out, 10, "--no-resume")) == 0
    for name in ("step-00000030", "step-00000040"):  # as a crash right after `latest` named step-00000010 leaves it
        shutil.copytree(earlier / name, out / "checkpoints" / name)
    assert _kept(out) == (["step-00000010", "step-00000030", "step-00000040"], "step-00000010")
    capsys.readouterr()
    assert main(_train(out, 20)) == 0
    said = capsys.readouterr().out
    assert "resumed from" in said and "step-00000030, step-00000040" in said
    assert _kept(out) == (["step-00000010", "step-00000020"], "step-00000020")


def test_a_fresh_task_run_removes_an_earlier_runs_epoch_checkpoints_and_is_resumed(tmp_path, capsys):
    out = tmp_path / "task"

    def train(epochs: int, *extra: str) -> int:
        return main(["train", "--task", "fedpar.tasks.zoo:classifier", "--task-option", "model=mlp", "--task-option",
                     "dataset=digits", "--device", "cpu", "--no-plot", "--checkpoint-every", "3", "--epochs",
                     str(epochs), "--out", str(out), *extra])

    assert train(5) == 0
    assert _kept(out) == (["epoch-000004", "epoch-000005"], "epoch-000005")
    capsys.readouterr()
    assert train(2, "--no-resume") == 0
    assert _kept(out) == (["epoch-000001", "epoch-000002"], "epoch-000002")
    said = capsys.readouterr()
    assert "earlier run" in said.out + said.err and "epoch-000004, epoch-000005" in said.out + said.err
    assert train(3) == 0
    said = capsys.readouterr()
    assert "resumed from" in said.out + said.err
    assert _kept(out) == (["epoch-000002", "epoch-000003"], "epoch-000003")
