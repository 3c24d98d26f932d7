"""A task and its data given to fedpar from Python, without the CLI, get the checks ``--task`` makes: the same
mistake is the same one line, raised at the call the program made."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fedpar import ClientData, Partition, Task, TaskError
from fedpar.client.task_trainer import TaskTrainer
from fedpar.server.assembly import CoordinatorAssembly

X, Y = torch.randn(40, 64), torch.randint(0, 10, (40,))


def _task(**changes) -> Task:
    fields = dict(model=lambda: nn.Linear(64, 10), client_data=lambda p: ClientData(TensorDataset(X, Y)),
                  loss=nn.functional.cross_entropy)
    return Task(**{**fields, **changes})


def test_a_module_given_as_the_model_is_refused_as_the_cli_refuses_it():
    # before: "model() raised TypeError: Linear.forward() missing 1 required positional argument" (for_task) and
    # the same in TaskTrainer
    task = _task(model=nn.Linear(64, 10))
    line = "model must be a function returning an nn.Module (write model=lambda: ...), got the module Linear itself"
    with pytest.raises(TaskError, match=r"^task 'task': " + line.replace("(", r"\(").replace(")", r"\)")):
        CoordinatorAssembly.for_task(task, 0, "cpu")
    with pytest.raises(TaskError, match="got the module Linear itself"):
        TaskTrainer(task, ClientData(TensorDataset(X, Y)))


def test_a_pair_of_tensors_as_client_data_is_refused_when_the_trainer_is_made():
    # before: accepted; each round then failed with 'stack expects each tensor to be equal size'
    with pytest.raises(TaskError, match=r"ClientData.train is a tuple of arrays, not a dataset of examples: give "
                                        r"TensorDataset\(inputs, targets\)"):
        TaskTrainer(_task(), ClientData((X, Y)))


def test_a_pair_of_tensors_as_the_trainers_data_says_what_to_give():
    # before: AttributeError: 'tuple' object has no attribute 'train'
    with pytest.raises(TaskError, match=r"^TaskTrainer's data must be fedpar.ClientData\(train, val\), got tuple$"):
        TaskTrainer(_task(), (X, Y))


@pytest.mark.parametrize("call", [lambda: CoordinatorAssembly.for_task("nope", 0, "cpu"),
                                  lambda: TaskTrainer("nope", ClientData(TensorDataset(X, Y)))])
def test_something_else_than_a_task_is_a_type_error_naming_the_call(call):
    # before: AttributeError: 'str' object has no attribute 'built_model'
    with pytest.raises(TypeError, match=r"^(CoordinatorAssembly.for_task|TaskTrainer) takes a fedpar.Task, got str"):
        call()


def test_a_good_task_still_builds_both_sides():
    task = _task(test_data=lambda: TensorDataset(X, Y))
    assembly = CoordinatorAssembly.for_task(task, 0, "cpu")
    trainer = TaskTrainer(task, task.client_data(Partition(0, 1)))
    assert assembly.names == [name for name, _, _ in trainer.array_specs()] == ["weight", "bias"]


def test_a_partition_is_checked_as_it_is_made_and_share_of_takes_only_one():
    # before: share_of(ds, 3): AttributeError: 'int' object has no attribute 'index'; Partition('0', 4) was made,
    # then "TypeError: '<=' not supported" inside share_of
    from fedpar.tasks import share_of

    dataset = TensorDataset(X, Y)
    with pytest.raises(TypeError, match=r"^share_of takes a fedpar.Partition\(index, count\), got int$"):
        share_of(dataset, 3)
    with pytest.raises(TypeError, match=r"^Partition's index must be an integer, got '0'$"):
        Partition("0", 4)
    with pytest.raises(TaskError, match=r"^partition index 4 is not in \[0, 4\)$"):
        Partition(4, 4)
    with pytest.raises(TaskError, match=r"^Partition's val_fraction must be in \[0, 1\)"):
        Partition(0, 4, val_fraction=1.0)
    assert len(share_of(dataset, Partition(1, 4, val_fraction=0.0)).train) == 10
