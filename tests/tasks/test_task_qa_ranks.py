"""`fedpar train --task --nproc 2 --fsdp 2` of a task whose optimizer factory steps a model of its own: the engine's
ranks refuse it in one line, as one process does, not train a model that never moves."""

from __future__ import annotations

from support.in_process import run_main

TASK = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset
from fedpar import ClientData, Task

X = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()


def task():
    return Task(model=lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                client_data=lambda p: ClientData(TensorDataset(X, Y)), loss=nn.functional.cross_entropy,
                optimizer=lambda params, lr: torch.optim.SGD(nn.Linear(4, 2).parameters(), lr))
'''


def test_an_optimizer_of_other_parameters_is_refused_on_the_engine_s_ranks(tmp_path, capfd):
    # before: both ranks trained 2 epochs of a model that never moved, and the run exited 0
    (tmp_path / "own_optimizer.py").write_text(TASK)
    run = run_main(["train", "--task", "own_optimizer.py:task", "--nproc", "2", "--fsdp", "2", "--epochs", "2",
                    "--batch-size", "16", "--device", "cpu", "--no-plot", "--out", "out"], capfd, tmp_path)
    assert run.returncode != 0, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert "optimizer(parameters, lr) holds none of the parameters it is given" in run.stderr.strip().splitlines()[-1]
