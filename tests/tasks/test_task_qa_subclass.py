"""A task written as a subclass of fedpar.Task: hooks written as its methods are not what fedpar calls (a Task's hooks
are its fields), so such a task is refused in one line saying how to give them, not trained without them; a reference
naming the class itself, not a Task or a factory, is one line saying so; so is a loss given as a module's class."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedpar.task import TaskError
from fedpar.tasks.reference import load_task
from support.in_process import run_main

TASKS = '''
from torch import nn
from torch.utils.data import TensorDataset
import torch
from fedpar import Task
from fedpar.tasks import share_of

TRAIN = TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))


class WithTrain(Task):
    def train(self, model, data, config, deadline):
        raise RuntimeError("my own loop, which fedpar never ran")


class WithEvaluate(WithTrain):
    def evaluate(self, model, dataset):
        return {"score": 1.0}


def with_train():
    return WithTrain(model=lambda: nn.Linear(4, 2), client_data=lambda p: share_of(TRAIN, p),
                     loss=nn.functional.cross_entropy)


def with_evaluate():
    return WithEvaluate(model=lambda: nn.Linear(4, 2), client_data=lambda p: share_of(TRAIN, p),
                        loss=nn.functional.cross_entropy, train=lambda *a: (0, {}))


def given_as_fields():  # a subclass whose hooks are given as fields, as a Task's are: fine
    return WithTrain(model=lambda: nn.Linear(4, 2), client_data=lambda p: share_of(TRAIN, p),
                     loss=nn.functional.cross_entropy, train=lambda *a: (0, {}), evaluate=lambda m, d: {})
'''


@pytest.fixture
def tasks(tmp_path: Path) -> Path:
    path = tmp_path / "subclassed.py"
    path.write_text(TASKS)
    return path


def test_hooks_written_as_methods_of_a_task_subclass_are_refused_in_one_line_as_the_task_loads(tasks, tmp_path,
                                                                                                capfd):
    # before: simulate and train ran the built-in loop and exited 0, the subclass's own train never called
    ref = f"{tasks}:with_train"
    run = run_main(["train", "--task", ref, "--epochs", "1", "--no-plot", "--out", str(tmp_path / "o")], capfd,
                   tmp_path)
    assert run.returncode == 2 and not (tmp_path / "o" / "global.safetensors").exists()
    assert run.stderr.strip().splitlines() == [
        f"fedpar train: task {ref!r}: WithTrain defines train() as a method, which fedpar does not call (a Task's "
        "hooks are its fields): give it as one, WithTrain(..., train=FUNCTION)"]
    with pytest.raises(TaskError, match=r"WithEvaluate defines evaluate\(\) as a method"):  # train is given: fine
        load_task(f"{tasks}:with_evaluate")
    assert load_task(f"{tasks}:given_as_fields").train is not None


def test_a_reference_to_a_task_class_says_to_name_a_factory_or_a_task(tasks, tmp_path, capfd):
    # before: "cannot read the factory's parameters (name 'nn' is not defined)"
    ref = f"{tasks}:WithTrain"
    run = run_main(["simulate", "--task", ref, "--clients", "2", "--out", str(tmp_path / "o")], capfd, tmp_path)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"fedpar simulate: --task {ref} is the class WithTrain, a kind of fedpar.Task, not a Task: name a function "
        "returning one (def task(): return WithTrain(model=..., client_data=..., ...)), or a Task made in the file"]


def test_a_loss_given_as_a_module_class_is_told_to_be_an_instance(tmp_path, capfd):
    # before: "the task's evaluation raised RuntimeError: Boolean value of Tensor with more than one value is
    # ambiguous" (nn.CrossEntropyLoss(outputs, targets) builds a module, its weight the outputs)
    (tmp_path / "classes.py").write_text(
        "from torch import nn\nfrom fedpar import Task\n"
        "def task():\n"
        "    return Task(model=lambda: nn.Linear(4, 2), client_data=lambda p: None, loss=nn.CrossEntropyLoss)\n")
    run = run_main(["simulate", "--task", "classes.py:task", "--clients", "2", "--out", "o"], capfd, tmp_path)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        "fedpar simulate: task 'classes.py:task': loss is the class CrossEntropyLoss, which makes a loss module: give "
        "one, loss=nn.CrossEntropyLoss() (or a function such as nn.functional.cross_entropy)")
