"""A task's mistakes are one line and exit code 2, saying what is missing; module references load too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedpar.cli.main import main
from fedpar.task import TaskError
from fedpar.tasks.reference import load_task

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "own_task.py") + ":task"


def _one_line(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("argv, message", [
    (["--task", "/no/such/file.py:task"], "fedpar train: --task: no such file: /no/such/file.py"),
    (["--task", "fedpar.tasks.zoo:nothing"], "fedpar.tasks.zoo has no task factory called 'nothing'"),
    (["--task", "no_such_module_xyz:task"], "cannot import 'no_such_module_xyz'"),
    (["--task", "nocolon"], "is not a reference: write package.module:name or path/to/file.py:name"),
    (["--task", EXAMPLE], "needs --task-option csv=...; its options: csv (str); hidden (int, default 32); "
                          "weight_decay (float, default 0.0)"),
    (["--task", EXAMPLE, "--task-option", "csv=t.csv", "--task-option", "colour=red"], "has no option 'colour'"),
    (["--task", EXAMPLE, "--task-option", "csv=t.csv", "--task-option", "hidden=many"],
     "option 'hidden' must be an integer, got 'many'"),
    (["--task", "fedpar.tasks.zoo:classifier_for"], "needs --task-option model=..."),
    (["--task-option", "csv=t.csv"], "--task-option needs --task"),
    (["--task", "fedpar.tasks.zoo:classifier", "--nproc", "3"], "--batch-size 64 (global) must be divisible by "
                                                                 "data-parallel size 3 x grad-accum 1 = 3"),
    (["--task", "fedpar.tasks.zoo:classifier", "--task-option", "model=cnn", "--nproc", "2", "--tp", "2"],
     "task 'cnn on digits' declares no tensor-parallel plan (Task.tp_plan), so --tp does not apply to it; drop --tp, "
     "or give the task a tp_plan"),
    (["--task", "fedpar.tasks.zoo:classifier", "--nproc", "2", "--pp", "2"],
     "task 'mlp on digits' declares no pipeline stages, so --pp does not apply to it; spread the model with --fsdp "
     "(or --tp with a tp_plan) instead"),
    # on one process too: a task's --pp (or --tp without a plan) is wrong on any world size, said before the layout
    (["--task", "fedpar.tasks.zoo:classifier", "--pp", "2"],
     "task 'mlp on digits' declares no pipeline stages, so --pp does not apply to it"),
    (["--task", "fedpar.tasks.zoo:classifier", "--task-option", "model=cnn", "--tp", "2"],
     "task 'cnn on digits' declares no tensor-parallel plan (Task.tp_plan), so --tp does not apply to it"),
    (["--task", "fedpar.tasks.zoo:classifier", "--fsdp", "2"],
     "cannot infer --dp-replicate: world size 1 is not divisible by the product 2"),
])
def test_task_mistakes_are_one_line(argv, message, capsys, tmp_path):
    # --device cpu: with --nproc on a machine of fewer GPUs, the GPU count would be the mistake said first
    assert message in _one_line(["train", *argv, "--device", "cpu", "--out", str(tmp_path)], capsys)


def test_what_a_task_lacks_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("from torch import nn\nfrom fedpar import Task\n"
                   "def no_loss():\n    return Task(model=lambda: nn.Linear(2, 2), client_data=lambda p: None)\n"
                   "def not_a_task():\n    return 42\n"
                   "T = Task(model=lambda: nn.Linear(2, 2), client_data=lambda p: None, loss=nn.functional.mse_loss)\n")
    line = _one_line(["simulate", "--task", f"{bad}:no_loss", "--out", str(tmp_path / "o")], capsys)
    assert line.startswith(f"fedpar simulate: task '{bad}:no_loss': it needs a loss(outputs, targets) for the "
                           "built-in loop, or its own train(model, data, config, deadline) hook")
    line = _one_line(["serve", "--insecure", "--port", "0", "--task", f"{bad}:not_a_task"], capsys)
    assert line == f"fedpar serve: --task {bad}:not_a_task returned a int, not a fedpar.Task"
    assert load_task(f"{bad}:T").name == f"{bad}:T"  # a reference may name a Task itself
    with pytest.raises(TaskError, match="is a Task, not a factory: it takes no --task-option"):
        load_task(f"{bad}:T", {"x": 1})


def test_a_zoo_task_by_module_reference_trains_centrally(tmp_path, capsys):
    assert main(["train", "--task", "fedpar.tasks.zoo:classifier", "--task-option", "model=cnn",
                 "--max-steps", "3", "--no-plot", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["model"]["model"] == "cnn" and "test_accuracy" in summary
    capsys.readouterr()


def test_the_own_task_tutorial_shows_the_example_as_it_is():
    example = (ROOT / "examples" / "own_task.py").read_text()
    tutorial = (ROOT / "docs" / "tutorials" / "your-own-task.md").read_text()
    assert example[example.index("from dataclasses"):] in tutorial


@pytest.mark.parametrize("task, flags, message", [
    ("hooked", ["--nproc", "2", "--fsdp", "2"], "has its own train hook, which trains in one process; drop --nproc "
                                                "and the engine options (--fsdp, --dp-replicate, --tp; and torchrun)"),
    ("fedpar.tasks.zoo:classifier", ["--task-option", "model=cnn", "--nproc", "2", "--tp", "2"],
     "task 'cnn on digits' declares no tensor-parallel plan (Task.tp_plan), so --tp does not apply to it"),
])
def test_a_large_model_agent_refuses_what_its_task_cannot_do_in_one_line(task, flags, message, tmp_path, capsys):
    if task == "hooked":
        hooked = tmp_path / "hooked.py"
        hooked.write_text("import torch\nfrom torch import nn\nfrom fedpar import ClientData, Task\n"
                          "def task():\n"
                          "    data = torch.utils.data.TensorDataset(torch.zeros(4, 2),\n"
                          "                                          torch.zeros(4, dtype=torch.long))\n"
                          "    return Task(model=lambda: nn.Linear(2, 2), client_data=lambda p: ClientData(data),\n"
                          "                train=lambda *a: (0, {}), loss=nn.functional.cross_entropy)\n")
        task = f"{hooked}:task"
    line = _one_line(["client", "--insecure", "--agent-id", "a", "--task", task, *flags, "--device", "cpu"], capsys)
    assert line.startswith("fedpar client: task ") and message in line
