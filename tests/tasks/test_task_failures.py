"""A task whose own code raises as its members train: each member tells the coordinator at once (the runtime's one
failure report), so a round does not wait out its deadline for updates that will not come, and a run that fails
because of it ends with one line naming the task's error, with no traceback; an optimizer the built-in loop cannot
step (LBFGS, whose step needs a closure) is refused when the task loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedpar.cli.main import main
from fedpar.task import TaskError
from support.in_process import run_main
from support.own_task import write_table
from support.processes import port_from

FEDPAR = [sys.executable, "-m", "fedpar"]
DEADLINE = 60

TASKS = '''
import torch
from torch import nn
from fedpar import Task
from fedpar.datasets.tables import load_csv_table
from fedpar.tasks import share_of

TABLE = load_csv_table({csv!r})


class Broken(torch.optim.SGD):
    def step(self, closure=None):
        raise TypeError("Broken.step() cannot step\\nits second line")


def bad_loss(outputs, targets):
    raise ValueError("this loss is broken")


def _task(**hooks):
    features, classes = TABLE.input_shape[0], TABLE.num_classes
    hooks.setdefault("loss", nn.functional.cross_entropy)
    return Task(model=lambda: nn.Sequential(nn.Linear(features, 8), nn.ReLU(), nn.Linear(8, classes)),
                client_data=lambda partition: share_of(TABLE.train, partition), test_data=lambda: TABLE.test,
                **hooks)


def step_raises():
    return _task(optimizer=lambda params, lr: Broken(params, lr))


def loss_raises():
    return _task(loss=bad_loss, evaluate=lambda model, dataset: {{"accuracy": 0.5}})


def lbfgs():
    return _task(optimizer=lambda params, lr: torch.optim.LBFGS(params, lr))


def sized(hidden: int = 8):
    features, classes = TABLE.input_shape[0], TABLE.num_classes
    return Task(model=lambda: nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes)),
                client_data=lambda partition: share_of(TABLE.train, partition), test_data=lambda: TABLE.test,
                loss=nn.functional.cross_entropy)


def _no_client_3(partition):
    if partition.index == 3:
        raise KeyError("no rows for client 3")
    return share_of(TABLE.train, partition)


def data_raises():
    features, classes = TABLE.input_shape[0], TABLE.num_classes
    return Task(model=lambda: nn.Sequential(nn.Linear(features, 8), nn.ReLU(), nn.Linear(8, classes)),
                client_data=_no_client_3, test_data=lambda: TABLE.test, loss=nn.functional.cross_entropy)
'''


@pytest.fixture
def tasks(tmp_path: Path) -> Path:
    path = tmp_path / "broken_tasks.py"
    path.write_text(TASKS.format(csv=str(write_table(tmp_path / "table.csv"))))
    return path


def _run(args: list[str], cwd: Path, capfd) -> tuple[int, str, str, float]:
    """`fedpar ARGS` from ``cwd``, by its main in this process: its exit code, every process's stdout and stderr, and
    its seconds."""
    started = time.monotonic()
    out = run_main(args, capfd, cwd)
    return out.returncode, out.stdout, out.stderr, time.monotonic() - started


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_simulated_task_whose_training_step_raises_fails_its_rounds_at_once_and_says_so_in_one_line(tasks, capfd):
    # 15 members' tracebacks and 60 s a round (185 s for 3 rounds) before: now no round waits for the deadline
    ref = f"{tasks}:step_raises"
    out = tasks.parent / "run"
    rc, stdout, stderr, seconds = _run(["simulate", "--task", ref, "--clients", "20", "--clients-per-round", "5",
                                        "--rounds", "2", "--deadline", str(DEADLINE), "--out", str(out)], tasks.parent,
                                       capfd)
    assert rc == 1, stderr
    assert "Traceback" not in stdout + stderr, stderr
    line = (f"fedpar simulate: every round failed (2 of 2): the task's training raised TypeError: Broken.step() cannot "
            f"step: fix the task ({ref})")
    assert stderr.strip().splitlines()[-1] == line
    assert sum("Broken.step()" in text for text in stderr.splitlines()) == 1, stderr  # named once, at the end
    rows = _rows(out)
    assert [(r["status"], r["rejected"], r["close_reason"]) for r in rows] == \
        [("failed", 5, "every sampled agent answered")] * 2
    assert all(r["training_error"] == "training raised TypeError: Broken.step() cannot step" for r in rows)
    assert sum(r["round_seconds"] for r in rows) < 20, rows  # not 2 x the deadline
    assert seconds < DEADLINE, seconds
    assert json.loads((out / "summary.json").read_text())["training_error"] == rows[-1]["training_error"]


def test_a_deployed_agent_whose_task_raises_tells_the_coordinator_and_keeps_serving(tasks, capfd):
    # the loss raises: the agent's warm-up leaves it to the training, which each round tells the coordinator of
    ref = f"{tasks}:loss_raises"
    out = tasks.parent / "served"
    started = time.monotonic()
    rc, stdout, stderr, served, serve = _serve_one_agent(tasks, capfd, ref, out, [], timeout=60)
    assert rc == 1, stdout + stderr  # it took no part: exit 0 told its supervisor all was well
    assert "Traceback" not in stdout + stderr, stderr
    for round_id in (1, 2):  # the agent's own log: one line a round
        assert f"alice: round {round_id} task refused: training raised ValueError: this loss is broken" in stderr
    assert "2 tasks, 0 updates accepted, 2 refused" in stdout
    assert stderr.strip().splitlines()[-1] == (
        "fedpar client: alice: none of its 2 tasks ended in an update the coordinator took (the first: round 1 task: "
        "training raised ValueError: this loss is broken)"), stderr
    assert serve.returncode == 1 and "Traceback" not in served, served
    assert served.strip().splitlines()[-1] == (f"fedpar serve: every round failed (2 of 2): the task's training "
                                               f"raised ValueError: this loss is broken: fix the task ({ref})")
    assert sum(r["round_seconds"] for r in _rows(out)) < 20
    assert time.monotonic() - started < DEADLINE


def test_an_agent_whose_task_options_make_another_model_tells_the_coordinator_and_stops(tasks, capfd):
    # the same reference with another --task-option: the coordinator's model never fits the agent's, so the agent
    # tells its round and stops (exit 1), each side saying it as its own; not 'fix the task', which is fine
    ref = f"{tasks}:sized"
    out = tasks.parent / "other-options"
    rc, stdout, stderr, served, serve = _serve_one_agent(tasks, capfd, ref, out, ["--task-option", "hidden=16"],
                                                         timeout=DEADLINE, rounds=1)
    assert rc == 1 and "Traceback" not in stdout + stderr, stderr
    assert stderr.strip().splitlines()[-1] == (
        "fedpar client: alice: the coordinator's model does not fit this agent's task: tensor '0.weight' is "
        "float32[8, 4] there, float32[16, 4] here; start the agent with the coordinator's task and --task-option "
        "values (a Flower App: the one the coordinator's serve --flower-app runs)")
    reason = ("model does not fit the coordinator's: tensor '0.weight' is float32[8, 4] at the coordinator, "
              "float32[16, 4] at the agent (the agent's task or --task-option values differ)")
    assert f"round 1: alice answered with no update: its {reason}" in served
    assert serve.returncode == 1 and "Traceback" not in served and "fix the task" not in served, served
    assert served.strip().splitlines()[-1] == ("fedpar serve: every round failed (1 of 1): an agent's " + reason +
                                               "; start the agent with the coordinator's task and --task-option "
                                               "values (a Flower App: the one the coordinator's serve --flower-app "
                                               "runs)")
    assert [(r["status"], r["close_reason"], r["training_error"]) for r in _rows(out)] == \
        [("failed", "every sampled agent answered", reason)]


def _serve_one_agent(tasks, capfd, ref: str, out, agent_options: list[str], timeout: float, rounds: int = 2):
    """`fedpar serve` of task ``ref`` for ``rounds`` rounds of one agent (its own process), and agent alice with
    ``agent_options`` (its main in this process): the agent's exit code, stdout and stderr, what serve printed, and
    serve's process (ended)."""
    serve = subprocess.Popen([*FEDPAR, "serve", "--insecure", "--port", "0", "--task", ref, "--min-available", "1",
                              "--clients-per-round", "1", "--rounds", str(rounds), "--deadline", str(DEADLINE),
                              "--out", str(out)], cwd=tasks.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        lines = []
        port = port_from(serve, lines, "(PLAINTEXT (--insecure))")
        rc, stdout, stderr, _ = _run(["client", "--insecure", "--server", f"127.0.0.1:{port}", "--task", ref,
                                      *agent_options, "--agent-id", "alice", "--threads", "1", "--give-up-after",
                                      "30"], tasks.parent, capfd)
        served = "".join(lines) + serve.communicate(timeout=timeout)[0]
    finally:
        if serve.poll() is None:
            serve.kill()
    return rc, stdout, stderr, served, serve


@pytest.mark.parametrize("command", [["simulate", "--clients", "2", "--out", "out"],
                                     ["serve", "--insecure", "--port", "0", "--out", "out"],
                                     ["client", "--insecure", "--server", "127.0.0.1:1", "--agent-id", "a"],
                                     ["train", "--out", "out"]], ids=lambda c: c[0])
def test_an_optimizer_whose_step_needs_a_closure_is_refused_when_the_task_loads(command, tasks, capsys, monkeypatch):
    monkeypatch.chdir(tasks.parent)
    assert main([*command, "--task", f"{tasks}:lbfgs"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == (f"fedpar {command[0]}: task '{tasks}:lbfgs': its optimizer is a LBFGS, whose step() needs a "
                         "closure that evaluates the loss again; the built-in loop steps the optimizer once per batch "
                         "without one: use another optimizer (SGD, Adam, AdamW, ...), or step this one with a "
                         "closure in your own train(model, data, config, deadline) hook")
    assert all("Traceback" not in line for line in lines)


def test_a_process_whose_launcher_checked_the_task_loads_it_unchecked(tasks):
    # simulate's aggregator ranks: rank 0 refused a bad task before they started, and the optimizer check alone
    # costs a process 1.2 s of CPU (its first optimizer imports torch._dynamo)
    from fedpar.tasks.reference import load_task

    with pytest.raises(TaskError, match="its optimizer is a LBFGS"):
        load_task(f"{tasks}:lbfgs")
    assert load_task(f"{tasks}:lbfgs", check=False).optimizer is not None


def test_a_task_whose_client_data_raises_as_a_worker_starts_is_one_line_naming_the_client(tasks, capfd):
    # a worker counts its members' examples as it starts: the task's own error, not "worker process died"
    ref = f"{tasks}:data_raises"
    rc, stdout, stderr, _ = _run(["simulate", "--task", ref, "--clients", "6", "--rounds", "2", "--quiet"],
                                 tasks.parent, capfd)
    assert rc == 2, stderr
    assert "Traceback" not in stderr and "died" not in stderr, stderr
    assert stderr.strip().splitlines() == [f"fedpar simulate: the task's client_data raised KeyError: 'no rows for "
                                           f"client 3' for client-0003: fix the task ({ref})"], stderr
