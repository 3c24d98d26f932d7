"""A task whose own code calls sys.exit() (a training script turned task file, its argparse at the top; a helper that
gives up) is the task's failure said in one line, as any exception of its code is: not argparse's usage of another
program as fedpar's last word, not a factory's message alone with exit code 1, and not a coordinator that vanishes
while its workers wait a minute for it and die with tracebacks."""

from __future__ import annotations

import sys
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

X = torch.randn(120, 4, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()
TRAIN, TEST = TensorDataset(X[:100], Y[:100]), TensorDataset(X[100:], Y[100:])


def _task(**hooks):
    hooks.setdefault("model", lambda: nn.Linear(4, 2))
    hooks.setdefault("client_data", lambda p: share_of(TRAIN, p))
    return Task(test_data=lambda: TEST, loss=nn.functional.cross_entropy, **hooks)


def factory_exits():
    sys.exit("no such dataset")


def _model():
    sys.exit("cannot build the model")


def model_exits():
    return _task(model=_model)


def _data(partition):
    if partition.index == 1:
        sys.exit("no rows for client 1")
    return share_of(TRAIN, partition)


def data_exits():
    return _task(client_data=_data)


def _data_interrupting(partition):
    if partition.index == 1:
        raise KeyboardInterrupt
    return share_of(TRAIN, partition)


def data_interrupts():
    return _task(client_data=_data_interrupting)


CENTRAL = []


def _evaluate(model, dataset):
    if len(dataset) == len(TEST):  # the coordinator's; its first call is the check as the task loads
        CENTRAL.append(1)
        if len(CENTRAL) > 2:
            sys.exit("evaluation gave up")
    return {"score": 1.0}


def evaluation_exits():
    return _task(evaluate=_evaluate)


def _interrupting(model, dataset):
    if len(dataset) == len(TEST):
        CENTRAL.append(1)
        if len(CENTRAL) > 2:
            raise KeyboardInterrupt  # a library's way out of a long loop, say
    return {"score": 1.0}


def evaluation_interrupts():
    return _task(evaluate=_interrupting)


def _train(model, data, config, deadline):
    sys.exit("no GPU, giving up")


def train_exits():
    return _task(train=_train)
'''

SCRIPT = '''
import argparse
parser = argparse.ArgumentParser()
parser.add_argument("--hidden", type=int, default=16)
ARGS = parser.parse_args()  # fedpar's command line, not this script's
from tasks import evaluation_exits as task
'''


@pytest.fixture
def tasks(tmp_path: Path) -> Path:
    path = tmp_path / "tasks.py"
    path.write_text(TASKS)
    return path


def _simulate(ref: str, tasks: Path, capfd, *more: str):
    return run_main(["simulate", "--task", ref, "--clients", "3", "--rounds", "3", "--quiet", "--out",
                     str(tasks.parent / "out"), *more], capfd, tasks.parent)


@pytest.mark.parametrize("factory, code, line", [
    ("factory_exits", 2, "fedpar simulate: --task {ref}: the factory raised SystemExit: no such dataset"),
    ("model_exits", 2, "fedpar simulate: task '{ref}': model() raised SystemExit: cannot build the model"),
    ("data_exits", 2, "fedpar simulate: the task's client_data raised SystemExit: no rows for client 1 for "
                      "client-0001: fix the task ({ref})"),
    ("data_interrupts", 2, "fedpar simulate: the task's client_data raised KeyboardInterrupt for client-0001: fix the "
                           "task ({ref})"),
    ("evaluation_exits", 1, "fedpar simulate: the task's evaluation raised SystemExit: evaluation gave up: fix the "
                            "task ({ref})"),
    # no Ctrl-C reaches simulate's coordinator (its launcher takes the SIGINT): a KeyboardInterrupt there is the task's
    ("evaluation_interrupts", 1, "fedpar simulate: the task's evaluation raised KeyboardInterrupt: fix the task "
                                 "({ref})"),
])
def test_a_sys_exit_in_the_task_s_code_is_its_failure_in_one_line(factory, code, line, tasks, capfd):
    # before: 'no such dataset' alone, exit 1; the worker 'died with exit code 1' after its own line; and the
    # coordinator's evaluation ended the coordinator unsaid, its workers waiting 66 s for it and dying with tracebacks
    ref = f"{tasks}:{factory}"
    run = _simulate(ref, tasks, capfd, "--deadline", "30")
    assert run.returncode == code, run.stderr
    assert "Traceback" not in run.stderr and "died" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1] == line.format(ref=ref), run.stderr


def test_a_sys_exit_in_a_train_hook_under_fedpar_train_is_its_failure_in_one_line(tasks, capfd):
    # before: 'no GPU, giving up' alone, exit 1, as if fedpar had said it
    ref = f"{tasks}:train_exits"
    run = run_main(["train", "--task", ref, "--epochs", "1", "--no-plot", "--out", "out"], capfd, tasks.parent)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1].startswith(
        "fedpar train: the task's training raised SystemExit: no GPU, giving up"), run.stderr


def test_a_task_file_that_parses_the_command_line_as_it_loads_says_to_guard_its_script_part(tasks, capfd,
                                                                                            monkeypatch):
    # before: argparse's 'usage: fedpar [-h] [--hidden HIDDEN]' and 'fedpar: error: unrecognized arguments: simulate
    # --task ...', as if fedpar's own command line were wrong
    script = tasks.parent / "script.py"
    script.write_text(SCRIPT)
    argv = ["simulate", "--task", f"{script.name}:task", "--clients", "2", "--out", "out"]
    monkeypatch.setattr(sys, "argv", ["fedpar", *argv])  # what the script parses: fedpar's, not this test runner's
    run = run_main(argv, capfd, tasks.parent)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        "fedpar simulate: --task: running script.py failed: SystemExit: 2 (it exited as it was loaded: a file fedpar "
        "loads must not parse the command line or exit when imported; put its script part under if __name__ == "
        "'__main__':)")


@pytest.mark.parametrize("source, said", [
    ("def task(:\n    pass\n", "SyntaxError: invalid syntax (qa_module_syntax.py, line 1)"),
    ("raise RuntimeError('no data folder')\n", "RuntimeError: no data folder"),
    ("import sys\nsys.exit('no GPU')\n", "SystemExit: no GPU (it exited as it was loaded"),
], ids=["syntax", "raises", "exits"])
def test_a_task_module_that_fails_to_import_is_one_line_as_a_task_file_is(source, said, tmp_path, capfd, monkeypatch,
                                                                          request):
    # before: the import's traceback, exit 1 (a task file's failure was one line, exit 2, already)
    name = {"syntax": "qa_module_syntax", "raises": "qa_module_raises", "exits": "qa_module_exits"}[
        request.node.callspec.id]
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = run_main(["simulate", "--task", f"{name}:task", "--clients", "2", "--out", "out"], capfd, tmp_path)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(
        f"fedpar simulate: --task: importing {name!r} (from '{name}:task') failed: {said}"), run.stderr
