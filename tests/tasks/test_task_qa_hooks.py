"""A task's own train hook that breaks what fedpar relies on: one that replaces a layer or recasts the model (its
weights no longer the coordinator's layout), raises SystemExit or KeyboardInterrupt (which end a process, not a
member's training), or counts no examples though it had time, fails its member at once in one line, so the round
does not wait out its deadline; `fedpar train` does not write a model that model() cannot load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.in_process import run_main

TASKS = '''
import sys
import torch
from torch import nn
from torch.utils.data import TensorDataset
from fedpar import Task
from fedpar.tasks import share_of

g = torch.Generator().manual_seed(0)
X = torch.randn(240, 10, generator=g)
Y = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()   # 3 classes
TRAIN, TEST = TensorDataset(X[:200], Y[:200]), TensorDataset(X[200:], Y[200:])


def _task(train):
    return Task(model=lambda: nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3)),
                client_data=lambda p: share_of(TRAIN, p), test_data=lambda: TEST, loss=nn.functional.cross_entropy,
                train=train)


def _new_head(model, data, config, deadline):
    model[2] = nn.Linear(16, 4)  # a fourth class, say
    return len(data.train), {}


def _half(model, data, config, deadline):
    model.half()
    return len(data.train), {}


def _exits(model, data, config, deadline):
    sys.exit("no GPU here, giving up")


def _interrupts(model, data, config, deadline):
    raise KeyboardInterrupt


def new_head():
    return _task(_new_head)


def half():
    return _task(_half)


def exits():
    return _task(_exits)


def interrupts():
    return _task(_interrupts)


def counts_nothing():  # trains, but says it trained on no examples (which weigh its update)
    return _task(lambda model, data, config, deadline: (0, {"loss": 1.0}))
'''

DEADLINE = 60


@pytest.fixture
def tasks(tmp_path: Path) -> Path:
    path = tmp_path / "hooks.py"
    path.write_text(TASKS)
    return path


CHANGED = {
    "new_head": "train changed the model's weights ('2.weight' float32 (4, 16), where model() made '2.weight' float32 "
                "(3, 16)); train the model it is given in place (no layer replaced, added or removed, no .half() or "
                ".double()): its weights are what the coordinator averages",
    "half": "train changed the model's weights ('0.weight' float16 (16, 10), where model() made '0.weight' float32 "
            "(16, 10)); train the model it is given in place",
}
ENDED = {
    "exits": "its training raised SystemExit: no GPU here, giving up, which would end the whole process: raise an "
             "exception instead",
    "interrupts": "its training raised KeyboardInterrupt, which would end the whole process: raise an exception "
                  "instead",
    "counts_nothing": "train returned 0 examples, though its deadline did not stop it: return how many examples it "
                      "trained on, each once per pass (they weigh its update)",
}


@pytest.mark.parametrize("factory", [*CHANGED, *ENDED])
def test_a_train_hook_that_breaks_the_model_or_ends_the_process_fails_its_members_at_once(factory, tasks, capfd):
    # before: each member's traceback ('update arrays hold 976 bytes; their layout needs 908', or 'Exception in thread
    # fedpar-seat0'), the seat gone, and every round waited out its deadline for updates that never came; a hook that
    # counted no examples was taken for a member out of time ('the deadline is short for them'), each round waiting
    # out its deadline, and the run ended 'too few updates arrived ... check --min-reports, --deadline'

    ref = f"{tasks}:{factory}"
    out = tasks.parent / "run"
    run = run_main(["simulate", "--task", ref, "--clients", "3", "--rounds", "2", "--deadline", str(DEADLINE),
                    "--quiet", "--out", str(out)], capfd, tasks.parent)
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stdout + run.stderr and "Exception in thread" not in run.stderr, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    said = {**CHANGED, **ENDED}[factory]
    assert last.startswith(f"fedpar simulate: every round failed (2 of 2): the task's training failed: task {ref!r}: "
                           f"{said}"), last
    assert last.endswith(f": fix the task ({ref})"), last
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["status"], r["close_reason"]) for r in rows] == [("failed", "every sampled agent answered")] * 2
    assert sum(r["round_seconds"] for r in rows) < DEADLINE / 2, rows  # not 2 x the deadline


@pytest.mark.parametrize("factory", list(CHANGED))
def test_centralized_training_does_not_write_a_model_its_task_cannot_load(factory, tasks, capfd):
    # before: new_head trained, wrote global.safetensors of 4 classes beside a global.json whose model() makes 3, and
    # exited 0; half failed in the evaluation ('mat1 and mat2 must have the same dtype'), naming no cause
    ref = f"{tasks}:{factory}"
    out = tasks.parent / "central"
    run = run_main(["train", "--task", ref, "--epochs", "2", "--no-plot", "--out", str(out)], capfd, tasks.parent)
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(f"fedpar train: task {ref!r}: {CHANGED[factory]}")
    assert not (out / "global.safetensors").exists()


def test_a_numpy_count_of_examples_is_a_whole_number_and_a_tensor_is_told_to_be_one(tasks):
    # before: "train must return a whole number of examples >= 0 first, got np.int64(10)", refusing every round of a
    # hook that counted with numpy; a tensor's count said nothing of .item()
    import numpy as np
    import torch

    from fedpar import Partition, TaskError
    from fedpar.client.task_trainer import TaskTrainer
    from fedpar.tasks.reference import load_task

    task = load_task(f"{tasks}:new_head")
    task.train = lambda model, data, config, deadline: (np.int64(10), {"loss": np.float32(0.5)})
    trainer = TaskTrainer(task, task.data_for(Partition(0, 2)))
    result = trainer.train(1, 8, 0.1)
    assert result.examples == 10 and type(result.examples) is int
    task.train = lambda model, data, config, deadline: (torch.tensor(10), {})
    with pytest.raises(TaskError, match=r"train must return a whole number of examples >= 0 first \(an int: "
                                        r"\.item\(\) of a tensor\), got tensor\(10\)"):
        trainer.train(1, 8, 0.1)


def test_an_optimizer_made_of_other_parameters_than_it_is_given_fails_the_training_in_one_line(tasks):
    # before: it stepped a model of its own, so the federated one never moved: every round 'ok', the test loss the
    # same to the last digit, exit 0
    import torch
    from torch import nn

    from fedpar import Partition, TaskError
    from fedpar.client.task_trainer import TaskTrainer
    from fedpar.tasks.reference import load_task

    task = load_task(f"{tasks}:new_head")
    task.train = None
    task.optimizer = lambda params, lr: torch.optim.SGD(nn.Linear(10, 3).parameters(), lr)
    trainer = TaskTrainer(task, task.data_for(Partition(0, 2)))
    with pytest.raises(TaskError, match=r"optimizer\(parameters, lr\) holds none of the parameters it is given \(a "
                                        r"model of its own\?\): make it of them, e.g. torch.optim.Adam\(parameters, "
                                        r"lr\)"):
        trainer.train(1, 8, 0.1)
    task.optimizer = lambda params, lr: torch.optim.Adam(params, lr)  # as meant: trains
    assert trainer.train(1, 8, 0.1).examples > 0
