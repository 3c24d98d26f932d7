"""A kill -9 between put_in_place's two renames (no held stop holds it) left the folder `latest` named set aside as
NAME.old and no folder NAME: a resume then said the checkpoint was missing. The set-aside folder gets its name back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedpar.parallel import checkpoint_retention
from fedpar.parallel.checkpoint import latest_checkpoint
from fedpar.parallel.epoch_checkpoint import MODEL_FILE, latest_epoch_checkpoint, save_epoch_checkpoint


def _cut_between_the_renames(directory, name):
    """The folders as a kill -9 leaves them after put_in_place's first rename: the one `latest` names set aside,
    the new one complete but still staged."""
    target = directory / name
    target.rename(checkpoint_retention.set_aside(target))
    staged = directory / f"{name}.partial"
    staged.mkdir()
    (staged / "new").write_text("the new run's, complete")
    return target


def test_a_task_checkpoint_cut_between_its_renames_resumes_from_the_folder_latest_named(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    written = save_epoch_checkpoint(tmp_path, model, {"epoch": 1}, {"--lr": "0.1"})
    kept = (written / MODEL_FILE).read_bytes()
    target = _cut_between_the_renames(tmp_path, written.name)
    assert not target.exists()
    assert latest_epoch_checkpoint(tmp_path, "pass --no-resume") == target
    assert (target / MODEL_FILE).read_bytes() == kept
    assert not checkpoint_retention.set_aside(target).exists()


def test_a_step_checkpoint_cut_between_its_renames_resumes_from_the_folder_latest_named(tmp_path):
    target = tmp_path / "step-00000010"
    target.mkdir()
    (target / ".metadata").write_text("the earlier run's")
    (tmp_path / "latest").write_text("step-00000010\n")
    _cut_between_the_renames(tmp_path, target.name)
    assert latest_checkpoint(tmp_path) == target
    assert (target / ".metadata").read_text() == "the earlier run's"


def test_the_next_swap_over_a_cut_one_never_removes_the_checkpoint_latest_named(tmp_path):
    """put_in_place used to remove NAME.old first, the only complete checkpoint: a swap that then failed (here its
    staged folder is gone) lost it."""
    target = tmp_path / "epoch-000001"
    target.mkdir()
    (target / "old").write_text("the earlier run's")
    (tmp_path / "latest").write_text("epoch-000001\n")
    _cut_between_the_renames(tmp_path, target.name)
    staged = tmp_path / "epoch-000001.partial"
    with pytest.raises(FileNotFoundError):
        checkpoint_retention.put_in_place(tmp_path / "gone.partial", target, tmp_path / "latest")
    checkpoint_retention.restore_set_aside(target)
    assert (target / "old").read_text() == "the earlier run's"
    checkpoint_retention.put_in_place(staged, target, tmp_path / "latest")
    assert (target / "new").read_text() == "the new run's, complete" and not (target / "old").exists()
    assert not checkpoint_retention.set_aside(target).exists() and not staged.exists()
    assert (tmp_path / "latest").read_text() == "epoch-000001\n"
