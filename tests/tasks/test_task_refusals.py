"""A task whose model, data or central evaluation cannot be used is one line, never a traceback: refused as it loads
(exit code 2) when it can be told then, else the run stops with the line (exit code 1); its reference is one colon
and global.json keeps a file's by its absolute path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedpar.cli.main import main
from fedpar.tasks.reference import load_task
from support.in_process import run_main
from support.processes import port_from

FEDPAR = [sys.executable, "-m", "fedpar"]

TASKS = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset
from fedpar import Task
from fedpar.tasks import share_of

g = torch.Generator().manual_seed(0)
X = torch.randn(200, 10, generator=g)
Y = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()   # 3 classes
TRAIN, TEST = TensorDataset(X[:160], Y[:160]), TensorDataset(X[160:], Y[160:])


def _task(model=lambda: nn.Linear(10, 3), client_data=lambda p: share_of(TRAIN, p), **hooks):
    return Task(model=model, client_data=client_data, test_data=lambda: TEST, loss=nn.functional.cross_entropy,
                **hooks)


def good():
    return _task()


def wrong_out():   # 2 outputs for 3 classes
    return _task(model=lambda: nn.Linear(10, 2))


def model_is_instance():
    return _task(model=nn.Linear(10, 3))


def model_not_module():
    return _task(model=lambda: "linear")


def no_params_model():
    return _task(model=lambda: nn.ReLU())


def data_not_clientdata():
    return _task(client_data=lambda p: TRAIN)


def data_tuple():
    return _task(client_data=lambda p: (X, Y))


CALLS = []


def _fails_on_the_test_set_after_its_first_call(broken):
    def evaluate(model, dataset):
        if len(dataset) == len(TEST):  # the coordinator's central evaluation (the members' shares are smaller)
            CALLS.append(1)
            if len(CALLS) > 1:
                return broken()
        return {"score": 1.0}
    return evaluate


def _raise():
    raise IndexError("Target 2 is out of bounds")


def evaluation_raises_later():
    return _task(evaluate=_fails_on_the_test_set_after_its_first_call(_raise))


def evaluation_returns_a_float_later():
    return _task(evaluate=_fails_on_the_test_set_after_its_first_call(lambda: 0.5))
'''


@pytest.fixture
def tasks(tmp_path: Path) -> Path:
    path = tmp_path / "refused_tasks.py"
    path.write_text(TASKS)
    return path


def _run(args: list[str], cwd: Path, capfd) -> subprocess.CompletedProcess:
    """`fedpar ARGS` from ``cwd``, by its main in this process: its exit code and every process's stdout and stderr."""
    return run_main(args, capfd, cwd)


def _one_line(argv: list[str], capsys, code: int = 2) -> str:
    assert main(argv) == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# On the CPU: on CUDA an out-of-range target is a device-side assert (said as such), and it ends every later CUDA call
# of the process, the tests after it in the same pytest worker included.
ON_CPU = ["--device", "cpu"]


@pytest.mark.parametrize("command", [["simulate", "--clients", "2", "--workers", "1", "--quiet", *ON_CPU],
                                     ["serve", "--insecure", "--port", "0", *ON_CPU]], ids=lambda c: c[0])
def test_a_central_evaluation_that_cannot_run_is_refused_as_the_task_loads(command, tasks, tmp_path, capsys):
    # it crashed the coordinator after round 1 (a traceback, exit 1, no word of the task)
    ref = f"{tasks}:wrong_out"
    line = _one_line([*command, "--task", ref, "--out", str(tmp_path / "out")], capsys)
    assert line == (f"fedpar {command[0]}: the task's evaluation raised IndexError: Target 2 is out of bounds.: fix "
                    f"the task ({ref})")


@pytest.mark.parametrize("factory, line", [
    ("evaluation_raises_later", "the task's evaluation raised IndexError: Target 2 is out of bounds: fix the task "
                                "({ref})"),
    ("evaluation_returns_a_float_later", "task '{ref}': evaluate must return a dict of named metrics, got float"),
])
def test_a_central_evaluation_that_fails_in_a_round_stops_the_simulation_in_one_line(factory, line, tasks, capfd):
    # the coordinator logged 'coordinator stopped with an error' and the traceback before the command's own line
    ref = f"{tasks}:{factory}"
    run = _run(["simulate", "--task", ref, "--clients", "2", "--workers", "1", "--rounds", "3", "--quiet", *ON_CPU,
                "--out", str(tasks.parent / "out")], tasks.parent, capfd)
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr and "stopped with an error" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines() == [f"fedpar simulate: {line.format(ref=ref)}"]


def test_a_served_central_evaluation_that_fails_in_a_round_stops_the_coordinator_in_one_line(tasks, capfd):
    ref = f"{tasks}:evaluation_raises_later"
    serve = subprocess.Popen([*FEDPAR, "serve", "--insecure", "--port", "0", *ON_CPU, "--task", ref,
                              "--min-available", "1",
                              "--clients-per-round", "1", "--rounds", "3", "--out", str(tasks.parent / "served")],
                             cwd=tasks.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        lines = []
        port = port_from(serve, lines, "(PLAINTEXT (--insecure))")
        client = _run(["client", "--insecure", "--server", f"127.0.0.1:{port}", *ON_CPU, "--task", ref,
                       "--agent-id", "alice",
                       "--threads", "1", "--give-up-after", "1"], tasks.parent, capfd)
        served = "".join(lines) + serve.communicate(timeout=60)[0]
    finally:
        if serve.poll() is None:
            serve.kill()
    # the agent trained round 1 (it may not hear that training is over: the coordinator stops at once, and the agent
    # then gives up after --give-up-after 1 s of backing off, not 5 s and its longer backoffs)
    assert "round 1 task refused" not in client.stderr, client.stderr
    assert serve.returncode == 1, served
    assert "Traceback" not in served and "stopped with an error" not in served, served
    assert served.strip().splitlines()[-1] == (f"fedpar serve: the task's evaluation raised IndexError: Target 2 is "
                                               f"out of bounds: fix the task ({ref}) (--debug shows the traceback)")


@pytest.mark.parametrize("factory, problem", [
    ("model_is_instance", "model must be a function returning an nn.Module (write model=lambda: ...), got the module "
                          "Linear itself"),
    ("model_not_module", "model must be a function returning an nn.Module (write model=lambda: ...); model() "
                         "returned a str"),
    ("no_params_model", "model() has no floating-point parameters: nothing to train or average"),
])
def test_a_model_that_cannot_be_federated_is_refused_as_the_task_loads(factory, problem, tasks, tmp_path, capsys):
    # tracebacks before: from the coordinator's assembly, or 'an update must contain at least one array'
    ref = f"{tasks}:{factory}"
    line = _one_line(["simulate", "--task", ref, "--clients", "2", "--workers", "1", "--out", str(tmp_path / "o")],
                     capsys)
    assert line == f"fedpar simulate: task '{ref}': {problem}"


@pytest.mark.parametrize("factory, kind", [("data_not_clientdata", "TensorDataset"), ("data_tuple", "tuple")])
def test_client_data_of_the_wrong_kind_is_one_line_from_all_the_workers(factory, kind, tasks, capfd):
    # each worker printed its traceback, then 'worker process died ... give --checkpoint-dir'
    ref = f"{tasks}:{factory}"
    run = _run(["simulate", "--task", ref, "--clients", "4", "--workers", "2", "--rounds", "2", "--quiet"],
               tasks.parent, capfd)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [f"fedpar simulate: client_data must return fedpar.ClientData(train, "
                                               f"val), got {kind}: fix the task ({ref})"], run.stderr


def test_a_reference_of_two_colons_says_how_a_reference_is_written(tasks, tmp_path, capsys):
    ref = f"{tasks}:good:x"  # was: No module named '.../refused_tasks'
    line = _one_line(["simulate", "--task", ref, "--out", str(tmp_path / "o")], capsys)
    assert line == (f"fedpar simulate: --task: {ref!r} is not a reference: write package.module:name or "
                    "path/to/file.py:name")


def test_global_json_names_a_task_file_by_its_absolute_path_so_it_loads_from_anywhere(tasks, tmp_path, monkeypatch,
                                                                                       capfd):
    run = _run(["simulate", "--task", f"{tasks.name}:good", "--clients", "2", "--workers", "1", "--rounds", "1",
                "--quiet", "--out", "out"], tasks.parent, capfd)
    assert run.returncode == 0, run.stderr
    model = json.loads((tasks.parent / "out" / "global.json").read_text())["model"]
    assert model == {"task": f"{tasks}:good", "task_options": {}}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert load_task(model["task"], model["task_options"]).model().out_features == 3


@pytest.mark.parametrize("command, zoo, named", [
    (["simulate", "--clients", "2", "--out", "o"], ["--model", "cnn", "--data-dir", "x"],
     "--model and --data-dir would be ignored: drop them"),
    (["serve", "--insecure", "--port", "0", "--out", "o"], ["--dataset", "mnist"],
     "--dataset would be ignored: drop it"),
    (["client", "--insecure", "--agent-id", "a"], ["--dataset", "mnist"], "--dataset would be ignored: drop it"),
    (["train", "--max-steps", "1", "--out", "o"], ["--data-path", "x.txt"], "--data-path would be ignored: drop it"),
], ids=lambda c: c[0] if isinstance(c, list) and c[0] in ("simulate", "serve", "client", "train") else "")
def test_the_zoo_s_flags_beside_a_task_are_refused_not_ignored(command, zoo, named, tasks, tmp_path, monkeypatch,
                                                                 capsys):
    # they were ignored: `simulate --task X --model cnn` trained the task's model and said nothing
    monkeypatch.chdir(tmp_path)
    line = _one_line([*command, "--task", f"{tasks}:good", *zoo], capsys)
    assert line == (f"fedpar {command[0]}: --task brings its own model and data, so {named} (its own settings are "
                    "--task-option KEY=VALUE)")
