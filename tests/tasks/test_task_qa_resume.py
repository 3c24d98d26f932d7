"""`fedpar train --task` resumed after the task's model changed (a width edited in the task's file, the reference and
options the same): one line saying which weight differs and to pass --no-resume, not a traceback ending 'Error(s) in
loading state_dict for Sequential:'."""

from __future__ import annotations

from pathlib import Path

from support.in_process import run_main

TASK = '''
from pathlib import Path
import torch
from torch import nn
from torch.utils.data import TensorDataset
from fedpar import ClientData, Task

X = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()
WIDTH = Path(__file__).with_name("width.txt")  # the edit between the runs


def task():
    return Task(model=lambda: nn.Sequential(nn.Linear(4, int(WIDTH.read_text())), nn.ReLU(),
                                            nn.Linear(int(WIDTH.read_text()), 2)),
                client_data=lambda p: ClientData(TensorDataset(X, Y)), loss=nn.functional.cross_entropy)
'''


def test_resuming_after_the_task_s_model_changed_is_one_line_saying_what_differs(tmp_path: Path, capfd):
    (tmp_path / "edited.py").write_text(TASK)
    (tmp_path / "width.txt").write_text("8")
    command = ["train", "--task", "edited.py:task", "--epochs", "2", "--checkpoint-every", "1", "--no-plot",
               "--out", "out"]
    assert run_main(command, capfd, tmp_path).returncode == 0
    (tmp_path / "width.txt").write_text("16")
    run = run_main([*command[:4], "3", *command[5:]], capfd, tmp_path)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(
        "fedpar train: cannot resume from out/checkpoints/epoch-000002: its weights are another model's (size "
        "mismatch for 0.weight: copying a param with shape torch.Size([8, 4]) from checkpoint, the shape in current "
        "model is torch.Size([16, 4]).); pass --no-resume to start afresh in out (or another --out)"), run.stderr
