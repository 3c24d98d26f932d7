"""A task whose test_data() gives an empty dataset (a split cut at the wrong index, a filter that kept nothing) is
refused in one line as it loads, not run with no central evaluation and no word of it; None stays the way to say
there is none. A client whose client_data holds no training examples is named, among many. A DataLoader given where a
dataset goes is refused as the task loads, saying to give its dataset."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.in_process import run_main

TASKS = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset
from fedpar import ClientData, Task
from fedpar.tasks import share_of

X = torch.randn(100, 4, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()
TRAIN, TEST = TensorDataset(X[:80], Y[:80]), TensorDataset(X[100:], Y[100:])  # the test split cut past the end


def task():
    return Task(model=lambda: nn.Linear(4, 2), client_data=lambda p: share_of(TRAIN, p), test_data=lambda: TEST,
                loss=nn.functional.cross_entropy)


def _one_empty(partition):
    if partition.index == 2:
        return ClientData(TensorDataset(X[:0], Y[:0]))
    return share_of(TRAIN, partition)


def one_client_empty():
    return Task(model=lambda: nn.Linear(4, 2), client_data=_one_empty, loss=nn.functional.cross_entropy)


def _loader_data(partition):
    return ClientData(torch.utils.data.DataLoader(share_of(TRAIN, partition).train, batch_size=32, shuffle=True))


def loader_data():  # a DataLoader where a dataset goes, as a PyTorch script hands one to its loop
    return Task(model=lambda: nn.Linear(4, 2), client_data=_loader_data, loss=nn.functional.cross_entropy)


def loader_test():
    return Task(model=lambda: nn.Linear(4, 2), client_data=lambda p: share_of(TRAIN, p),
                loss=nn.functional.cross_entropy,
                test_data=lambda: torch.utils.data.DataLoader(TensorDataset(X[80:], Y[80:]), batch_size=32))


def without():
    return Task(model=lambda: nn.Linear(4, 2), client_data=lambda p: share_of(TRAIN, p), test_data=lambda: None,
                loss=nn.functional.cross_entropy)
'''


@pytest.fixture
def tasks(tmp_path: Path) -> Path:
    path = tmp_path / "empty_test.py"
    path.write_text(TASKS)
    return path


@pytest.mark.parametrize("command", [["simulate", "--clients", "2", "--rounds", "1", "--quiet"],
                                     ["train", "--epochs", "1", "--no-plot"]], ids=lambda c: c[0])
def test_an_empty_test_set_is_refused_in_one_line_and_none_still_means_no_central_evaluation(command, tasks, capfd):
    # before: both ran to the end, exit 0, with no test metrics and no word of why
    ref = f"{tasks}:task"
    out = tasks.parent / "out"
    run = run_main([command[0], "--task", ref, *command[1:], "--out", str(out)], capfd, tasks.parent)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"fedpar {command[0]}: task {ref!r}: test_data() gave a dataset of no examples: return the held-out examples, "
        "or None for no central evaluation"), lines
    assert not (out / "global.safetensors").exists()
    run = run_main([command[0], "--task", f"{tasks}:without", *command[1:], "--out", str(out)], capfd, tasks.parent)
    assert run.returncode == 0, run.stderr


def test_a_client_with_no_training_examples_is_named(tasks, capfd):
    # before: each round it was sampled in failed it ('1 of 6 sampled agents failed their task: data failed: task
    # ...: client_data gave no training examples'), which of them not said
    ref = f"{tasks}:one_client_empty"
    run = run_main(["simulate", "--task", ref, "--clients", "6", "--rounds", "1", "--quiet", "--out", "out"], capfd,
                   tasks.parent)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [f"fedpar simulate: task {ref!r}: client_data gave no training examples "
                                               f"for client-0002: fix the task ({ref})"]
    run = run_main(["client", "--insecure", "--server", "127.0.0.1:9", "--agent-id", "a", "--task", ref,
                    "--num-partitions", "3", "--partition-index", "2"], capfd, tasks.parent)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(
        f"fedpar client: task {ref!r}: client_data gave no training examples for partition 2 of 3"), run.stderr


@pytest.mark.parametrize("factory, what", [("loader_data", "client_data's ClientData.train"),
                                           ("loader_test", "the dataset to evaluate (test_data())")])
def test_a_dataloader_where_a_dataset_goes_is_refused_as_the_task_loads(factory, what, tasks, capfd):
    # before: every round failed, "the task's training raised TypeError: 'DataLoader' object is not subscriptable"
    ref = f"{tasks}:{factory}"
    run = run_main(["simulate", "--task", ref, "--clients", "2", "--rounds", "2", "--quiet", "--out", "out"], capfd,
                   tasks.parent)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{what} is a DataLoader, which batches a dataset, not the dataset: give its dataset " \
        "(loader.dataset); fedpar batches it (a task's loader(dataset, batch_size, generator) says how)" in lines[0], \
        lines
