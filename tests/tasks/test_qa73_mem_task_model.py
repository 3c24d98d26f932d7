"""QA: `fedpar train --task module:Task` ran no memory check: a task whose model and optimizer state cannot fit
went on to build it (a RuntimeError of torch's allocator from each rank, or the kernel's OOM killer), where the zoo's
models are refused in one line before any rank starts. The task's model is now built on the meta device and checked
with the same estimate (parallel/preflight.py check_ranks_fit), per rank."""

from __future__ import annotations

import pytest

from support.in_process import run_main

pytestmark = pytest.mark.timeout(120)

TASK = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset
from fedpar import ClientData, Task

X = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()


def huge():  # 10^12 parameters: about 15 TiB of fp32 state on each rank
    return Task(model=lambda: nn.Sequential(nn.Linear(4, 1_000_000), nn.Linear(1_000_000, 1_000_000),
                                            nn.Linear(1_000_000, 2)),
                client_data=lambda p: ClientData(TensorDataset(X, Y)), loss=nn.functional.cross_entropy)


def small_model():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    float(model[0].weight.detach().sum())  # reads a value: cannot be built on the meta device
    return model


def not_on_meta():
    return Task(model=small_model, client_data=lambda p: ClientData(TensorDataset(X, Y)),
                loss=nn.functional.cross_entropy)
'''


@pytest.mark.parametrize("nproc, said, advice", [
    ("1", "training in this process needs about ",
     "give a smaller model (the task's model()), or shard it over machines with torchrun and --fsdp"),
    ("2", "training on 2 ranks here (--nproc 2) needs about ",
     "give a smaller --nproc or model, or spread the ranks over machines with torchrun")])
def test_a_task_model_whose_state_does_not_fit_is_one_line_before_any_rank(tmp_path, capfd, nproc, said, advice):
    (tmp_path / "big.py").write_text(TASK)
    done = run_main(["train", "--task", "big.py:huge", "--nproc", nproc, "--device", "cpu", "--batch-size", "16",
                     "--no-plot", "--out", "out"], capfd, tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    line, = [line for line in done.stderr.splitlines() if line.strip()]
    assert line.startswith(f"fedpar train: {said}") and "GiB of memory and this machine has" in line, line
    assert line.endswith(advice), line
    assert not (tmp_path / "out" / "summary.json").exists()


def test_a_task_model_that_cannot_be_built_on_meta_is_not_checked_and_trains(tmp_path, capfd):
    (tmp_path / "small.py").write_text(TASK)
    done = run_main(["train", "--task", "small.py:not_on_meta", "--device", "cpu", "--batch-size", "16", "--epochs",
                     "1", "--no-plot", "--out", "out"], capfd, tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "global.safetensors").exists()
