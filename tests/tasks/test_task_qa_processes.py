"""A task whose factory builds another model in another process (a width from the process, the clock, an unseeded
draw): simulate's worker processes load the task anew, so their members' models would not be the coordinator's; it is
refused in one line as the workers start, not run with some workers' members failing every round and exit code 0."""

from __future__ import annotations

from pathlib import Path

from support.in_process import run_main

TASKS = '''
import multiprocessing
import torch
from torch import nn
from torch.utils.data import TensorDataset
from fedpar import Task
from fedpar.tasks import share_of

X = torch.randn(120, 4, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()
TRAIN = TensorDataset(X, Y)


def per_process():  # a size that depends on the process (here its name: simulate's workers are fedpar-worker-N)
    hidden = 16 if multiprocessing.current_process().name.startswith("fedpar-worker") else 8
    return Task(model=lambda: nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2)),
                client_data=lambda p: share_of(TRAIN, p), loss=nn.functional.cross_entropy)
'''


def test_a_factory_that_builds_another_model_in_each_process_is_refused_as_the_workers_start(tmp_path: Path, capfd):
    # before: "round 1: 2 of 4 sampled agents failed their task: model does not fit the coordinator's ... (the agent's
    # task or --task-option values differ)" each round, and exit code 0
    path = tmp_path / "drawn.py"
    path.write_text(TASKS)
    ref = f"{path}:per_process"
    run = run_main(["simulate", "--task", ref, "--clients", "4", "--workers", "2", "--rounds", "2", "--quiet",
                    "--out", "out"], capfd, tmp_path)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        f"fedpar simulate: task {ref!r}: model() made other weights in a worker process than in the coordinator's "
        "('0.weight' float32 (16, 4), where the coordinator's had '0.weight' float32 (8, 4)): the task must build "
        f"the same model in every process (no sizes from the process id, the clock or an unseeded draw): fix the task "
        f"({ref})")
