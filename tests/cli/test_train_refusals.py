"""`fedpar train` as a new user misuses it: a mistake is one line saying what to do, exit code 2, and loses nothing
already written (QA). A command is a real process where the process is the point (kill -9, Ctrl-C, torchrun's
variables in its environment, a second run beside a running one); the others run fedpar's main in this process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.in_process import main_here, run_main

FEDPAR = [sys.executable, "-m", "fedpar.cli.main"]


def _train(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """``fedpar train ARGS`` (2 steps of the mlp on digits, on the CPU) in ``cwd``, with ``env`` added to the
    environment: its exit code and stderr lines."""
    done = subprocess.run([*FEDPAR, "train", "--max-steps", "2", "--device", "cpu", "--no-plot", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    return done.returncode, done.stderr.splitlines()


def _train_here(args: list[str], cwd: Path, capfd) -> tuple[int, list[str]]:
    """As :func:`_train`, by fedpar's main in this process (its ranks, with --nproc 2, are processes all the same)."""
    done = run_main(["train", "--max-steps", "2", "--device", "cpu", "--no-plot", *args], capfd, cwd)
    return done.returncode, done.stderr.splitlines()


@pytest.mark.parametrize("written, table", [("[train]\nmodel_kwargs = 3\n", "[train.model_kwargs]"),
                                            ("model_kwargs = [1, 2]\n", "[model_kwargs]")])
def test_model_kwargs_in_a_config_file_that_is_no_table_is_one_line(written, table, tmp_path, capfd):
    """It was a TypeError's traceback, exit 1."""
    (tmp_path / "run.toml").write_text(written)
    code, lines = _train_here(["--config", "run.toml", "--out", "out"], tmp_path, capfd)
    assert (code, len(lines)) == (2, 1), lines
    assert lines[0].startswith(f"fedpar train: run.toml: model_kwargs: expected a table ({table} with a KEY = VALUE "
                               "line each), got "), lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_an_out_folder_that_cannot_be_made_is_one_line_and_exit_2(nproc, tmp_path, capfd):
    """It was exit 1, not naming --out ('No such file or directory: x in folder /proc; check the path')."""
    code, lines = _train_here(["--nproc", nproc, "--out", "/proc/x"], tmp_path, capfd)
    assert (code, len(lines)) == (2, 1), lines
    assert lines[0].startswith("fedpar train: --out /proc/x: cannot make the folder: No such file or directory"), lines


def test_a_second_run_into_the_out_of_a_running_one_is_refused_and_mixes_nothing_into_it(tmp_path, capfd):
    """Both ran: the second cut the first's metrics.jsonl and each appended its rows to the other's, and the last to
    end left its summary beside the other's model. The first is a process of its own; the second, refused, runs here
    (capfd holds the first's output on a pipe of its own, apart)."""
    first = subprocess.Popen([*FEDPAR, "train", "--max-steps", "100000", "--log-every", "1", "--device", "cpu",
                              "--no-plot", "--out", "out"], cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        for line in first.stdout:
            if "training mlp on digits" in line:
                break
        code, lines = _train_here(["--model", "cnn", "--out", "out"], tmp_path, capfd)
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=60)
    finally:
        first.kill()
    assert (code, len(lines)) == (2, 1), lines
    assert lines[0].startswith(f"fedpar train: --out out is in use by another fedpar run (pid {first.pid}); wait for "
                               "it to end, or give another --out"), lines
    assert first.returncode == 130
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["model"] == "mlp"
    assert json.loads((tmp_path / "out" / "global.json").read_text())["model"]["model"] == "mlp"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_a_run_that_fails_before_it_logs_a_step_keeps_the_earlier_runs_outputs(nproc, tmp_path, capfd):
    """A diverging --lr (failed at step 2, logging every 10 steps) into an earlier run's --out: its metrics.jsonl was
    cut to nothing, beside that run's summary and model."""
    code, lines = _train_here(["--out", "out", "--plot"], tmp_path, capfd)
    assert code == 0, lines
    before = _files(tmp_path / "out")
    code, lines = _train_here(["--out", "out", "--lr", "1e30", "--log-every", "10", "--nproc", nproc], tmp_path, capfd)
    assert (code, len(lines)) == (1, 1) and "training diverged" in lines[0], lines
    assert _files(tmp_path / "out") == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(before)  # no .earlier-run left


def test_a_run_that_writes_replaces_every_file_of_the_earlier_run(tmp_path, capfd):
    """A --no-plot run into an earlier run's --out left that run's loss_curve.png beside its own outputs."""
    assert _train_here(["--out", "out", "--plot"], tmp_path, capfd)[0] == 0
    code, lines = _train_here(["--out", "out", "--model", "cnn"], tmp_path, capfd)
    assert code == 0, lines
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == \
        ["global.json", "global.safetensors", "metrics.csv", "metrics.jsonl", "summary.json"]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["model"] == "cnn"


TASKS = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset
from fedpar import Task
from fedpar.tasks import share_of

X = torch.randn(80, 10, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()   # 3 classes
TRAIN, TEST = TensorDataset(X[:64], Y[:64]), TensorDataset(X[64:], Y[64:])

def task(classes=3):
    return Task(model=lambda: nn.Linear(10, classes), client_data=lambda p: share_of(TRAIN, p),
                test_data=lambda: TEST, loss=nn.functional.cross_entropy)
'''


def test_a_task_that_fails_as_it_trains_keeps_the_earlier_runs_outputs(tmp_path, capfd):
    """A task whose model has too few outputs, into the --out of the same task's earlier run: its metrics.jsonl was
    cut to nothing."""
    (tmp_path / "tasks.py").write_text(TASKS)
    assert _train_here(["--task", "tasks.py:task", "--max-steps", "0", "--out", "out"], tmp_path, capfd)[0] == 0
    before = _files(tmp_path / "out")
    code, lines = _train_here(["--task", "tasks.py:task", "--task-option", "classes=2", "--max-steps", "0", "--out",
                               "out"], tmp_path, capfd)
    assert (code, len(lines)) == (1, 1) and "Target 2 is out of bounds" in lines[0], lines
    assert _files(tmp_path / "out") == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(before)


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_a_file_where_the_checkpoints_go_is_one_line_before_any_rank_starts(nproc, tmp_path, capfd):
    """Each rank failed at its first checkpoint with NotADirectoryError's traceback, exit 1."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoints").write_text("not a folder\n")
    code, lines = _train_here(["--checkpoint-every", "1", "--nproc", nproc, "--out", "out"], tmp_path, capfd)
    assert (code, len(lines)) == (2, 1), lines
    assert lines[0].startswith("fedpar train: --checkpoint-every 1: out/checkpoints, where the checkpoints are kept, "
                               "is a file, not a folder; move it away, or give another --out"), lines
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoints"]


def test_ctrl_c_before_a_step_is_logged_keeps_the_earlier_runs_outputs_and_says_it_wrote_nothing(tmp_path, capfd):
    """Two ranks stopped before they logged a step (their model is not gathered): the run wrote its summary of no
    step over the earlier run's, and cut that run's metrics.jsonl to nothing."""
    assert _train_here(["--out", "out", "--plot"], tmp_path, capfd)[0] == 0
    before = _files(tmp_path / "out")
    run = subprocess.Popen([*FEDPAR, "train", "--max-steps", "100000", "--log-every", "100000", "--nproc", "2",
                            "--device", "cpu", "--out", "out"], cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        for line in run.stdout:
            if "training mlp on digits" in line:
                break
        run.send_signal(signal.SIGINT)
        said = run.communicate(timeout=60)[0].strip().splitlines()
    finally:
        run.kill()
    assert run.returncode == 130, said
    assert said[-1].startswith("fedpar train: interrupted after 0 logged steps; wrote nothing to out; "), said
    assert _files(tmp_path / "out") == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(before)


def test_a_zoo_run_into_the_out_of_a_task_run_with_checkpoints_says_to_resume_it_with_its_task(tmp_path, capfd):
    """It said `latest` named no step-NNNNNNNN folder and to delete the file, the task run's only way to resume."""
    (tmp_path / "tasks.py").write_text(TASKS)
    code, lines = _train_here(["--task", "tasks.py:task", "--max-steps", "0", "--checkpoint-every", "1", "--out",
                               "out"], tmp_path, capfd)
    assert code == 0, lines
    before = _files(tmp_path / "out" / "checkpoints")
    code, lines = _train_here(["--checkpoint-every", "1", "--out", "out"], tmp_path, capfd)
    assert (code, lines) == (2, ["fedpar train: out/checkpoints/latest names epoch-000001, a checkpoint of `fedpar "
                                 "train --task` (a task's epochs), not of the zoo trainer's steps; resume it with that "
                                 "--task, or pass --no-resume to start afresh (or another --out)"]), lines
    assert _files(tmp_path / "out" / "checkpoints") == before


@pytest.mark.parametrize("env, said", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set in the environment but RANK, MASTER_ADDR, MASTER_PORT are not; launch "
                          "'fedpar train' with torchrun, or unset WORLD_SIZE"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
     "the environment's RANK=2, WORLD_SIZE=2, MASTER_PORT=1 make no group (RANK must be 0 to WORLD_SIZE - 1, "
     "MASTER_PORT 1 to 65535); launch 'fedpar train' with torchrun, or unset WORLD_SIZE, RANK, MASTER_ADDR, "
     "MASTER_PORT")])
def test_torchruns_variables_left_in_the_shell_are_one_line_saying_what_to_unset(env, said, tmp_path, capfd,
                                                                                monkeypatch):
    """They were a RuntimeError's traceback from init_distributed (exit 1), after --out was made. Refused before any
    group is joined: fedpar's main here, with the variables in this process's environment."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, lines = _train_here(["--out", "out"], tmp_path, capfd)
    assert (code, lines) == (2, [f"fedpar train: {said}"]), lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("task", [False, True])
def test_a_torchrun_rank_whose_group_never_forms_is_one_line_and_exit_2(task, tmp_path):
    """Rank 1 of 2 by hand, rank 0 never started: init_distributed's DistNetworkError traceback, exit 1."""
    with socket.socket() as probe:  # a port no one listens on once it is closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "tasks.py").write_text(TASKS)
    chosen = ["--task", "tasks.py:task"] if task else []
    code, lines = _train([*chosen, "--dist-timeout", "1", "--out", "out"], tmp_path,
                         {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert (code, len(lines)) == (2, 1), lines
    assert lines[0].startswith(f"fedpar train: rank 1 of 2: the other ranks did not all meet at 127.0.0.1:{port} "
                               "within 1 s; start every rank (torchrun on each node, the same --nnodes, --master-addr "
                               "and --master-port), or unset WORLD_SIZE for one process"), lines
    assert "Traceback" not in "\n".join(lines)


def test_a_config_file_that_spells_a_table_option_as_its_flag_is_told_the_table(tmp_path, capfd):
    """`task_option = "csv=..."`, as --task-option is spelled, was 'unknown option task_option' with no hint: the
    option it meant, task_options, was left out of the guesses for taking a table."""
    (tmp_path / "run.toml").write_text('[train]\ntask = "tasks.py:task"\ntask_option = "classes=3"\n')
    code, lines = _train_here(["--config", "run.toml", "--out", "out"], tmp_path, capfd)
    assert (code, lines) == (2, ["fedpar train: run.toml: unknown option(s) for 'train': task_option (did you mean "
                                 "task_options, a table with a KEY = VALUE line each?); run 'fedpar train --help' for "
                                 "the valid ones"]), lines


@pytest.mark.parametrize("given, said", [
    (["--momentum", "0.5", "--optimizer", "adamw"], "--momentum (it needs --optimizer sgd)"),
    (["--base-batch-size", "32"], "--base-batch-size (it needs --lr-scaling linear or sqrt)"),
    (["--lr-scaling", "linear"], "--lr-scaling (it needs --base-batch-size, the batch size --lr was tuned for)"),
    # a switch turned off is named as typed (QA: --no-sequence-parallel was said as --sequence-parallel)
    (["--no-sequence-parallel"], "--no-sequence-parallel (it needs --tp 2 or more)"),
    (["--cpu-offload"], "--cpu-offload (it needs --fsdp 2 or more)")])
def test_an_optimisation_option_the_run_would_ignore_is_refused_in_one_line(given, said, tmp_path, capfd):
    """Each trained as if it had not been given, exit 0 (the lr unscaled, AdamW without momentum)."""
    code, lines = _train_here([*given, "--out", "out"], tmp_path, capfd)
    assert (code, lines) == (2, [f"fedpar train: this run would ignore {said}: drop it, or give what it needs"]), lines
    assert not (tmp_path / "out").exists()


def _rows(out: Path) -> list[tuple[str, int, float]]:
    """OUT/metrics.jsonl's records: kind, step and loss (0.0 for none)."""
    return [(r["kind"], r["step"], r.get("loss", 0.0)) for r in map(json.loads, (out / "metrics.jsonl").open())]


def _kill_a_fresh_run(cwd: Path, log_every: str, killed_once) -> None:
    """``fedpar train --no-resume`` into cwd/out, on batches of 1 (an epoch: 1437 steps) logging every ``log_every``
    steps and keeping no checkpoint, killed (kill -9) once ``killed_once(out)`` holds."""
    killed = subprocess.Popen([*FEDPAR, "train", "--max-steps", "100000", "--log-every", log_every, "--no-resume",
                               "--batch-size", "1", "--device", "cpu", "--out", "out"], cwd=cwd,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not killed_once(cwd / "out"):
            assert killed.poll() is None and time.monotonic() < deadline, killed.returncode
            time.sleep(0.05)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
    finally:
        killed.kill()


def test_a_run_killed_before_its_first_step_leaves_the_earlier_runs_rows_to_the_run_that_resumes_it(tmp_path,
                                                                                                     capfd):
    """A --no-resume run killed (kill -9) before it logged a step left the earlier run's files set aside, and an
    empty metrics.jsonl in the way of its rows: the next run, resuming the earlier run's checkpoint, lost its rows
    1-4 (kept only in OUT/.earlier-run). Its `latest` is set aside too, and put back before the next run decides to
    resume it."""
    steps = ["--checkpoint-every", "2", "--log-every", "1"]
    assert _train_here([*steps, "--max-steps", "4", "--out", "out"], tmp_path, capfd)[0] == 0
    out, earlier = tmp_path / "out", _rows(tmp_path / "out")
    aside = out / ".earlier-run" / "checkpoints" / "latest"
    _kill_a_fresh_run(tmp_path, "100000", lambda out: aside.is_file())  # its first row: at step 100000
    assert not (out / "checkpoints" / "latest").exists()
    code, lines = _train_here([*steps, "--max-steps", "6", "--out", "out"], tmp_path, capfd)
    assert code == 0, lines
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 4
    rows = _rows(out)
    assert rows[:5] == earlier and [(kind, step) for kind, step, _ in rows[5:]] == [
        ("train", 5), ("train", 6), ("eval", 6)], rows
    assert (out / "checkpoints" / "latest").read_text() == "step-00000006\n"
    assert not (out / ".earlier-run").exists()


def test_a_fresh_run_killed_after_its_first_row_is_not_resumed_from_the_earlier_runs_checkpoint(tmp_path, capfd):
    """A --no-resume run killed after it logged steps, before its first checkpoint, left the earlier run's `latest`:
    the next run resumed the earlier run's step 4 over the killed run's rows 1-4 (of batches of 1), the earlier run's
    own rows lost. The killed run wrote: the earlier run's files and its `latest` are let go, and the next run
    starts afresh, as the earlier run did (its rows, step for step)."""
    steps = ["--checkpoint-every", "2", "--log-every", "1"]
    assert _train_here([*steps, "--max-steps", "4", "--out", "out"], tmp_path, capfd)[0] == 0
    out, earlier = tmp_path / "out", _rows(tmp_path / "out")
    metrics = out / "metrics.jsonl"  # set aside: the one there is the killed run's
    # `latest` is the last file set aside (the folder alone appears before the first file leaves)
    _kill_a_fresh_run(tmp_path, "1", lambda out: (out / ".earlier-run" / "checkpoints" / "latest").is_file()
                      and metrics.is_file() and metrics.stat().st_size > 0)
    assert not (out / "checkpoints" / "latest").exists()
    code, lines = _train_here([*steps, "--max-steps", "4", "--out", "out"], tmp_path, capfd)
    assert code == 0, lines
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 0
    assert _rows(out) == earlier
    assert not (out / ".earlier-run").exists()


def test_a_fresh_run_stopped_after_its_checkpoint_says_to_resume_it_without_no_resume(tmp_path):
    """It said 'the same command resumes from its checkpoint', but the same command, --no-resume and all, starts
    afresh again."""
    # a checkpoint soon (a stop that lands in a save keeps the last complete one, and says so as well)
    run = subprocess.Popen([*FEDPAR, "train", "--max-steps", "100000", "--log-every", "100000", "--checkpoint-every",
                            "50", "--no-resume", "--batch-size", "1", "--device", "cpu", "--out", "out"], cwd=tmp_path,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "out" / "checkpoints" / "latest").is_file():
            assert run.poll() is None and time.monotonic() < deadline, run.returncode
            time.sleep(0.05)
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=60)
    finally:
        run.kill()
    latest = (tmp_path / "out" / "checkpoints" / "latest").read_text().strip()
    assert run.returncode == 130 and err.splitlines()[-1].endswith(
        f"; the same command without --no-resume resumes from its checkpoint {latest}"), err


@pytest.fixture(scope="module")
def train_help() -> str:
    """What `fedpar train --help` prints (by fedpar's main here), one line an option."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", "1000")
        done = main_here("train", "--help")
    assert done.returncode == 0 and done.stderr == "", done
    return done.stdout


def test_the_help_of_out_does_not_say_a_pipeline_keeps_its_model_only_in_its_checkpoints(train_help):
    """It said 'with --pp its model only there' (in OUT/checkpoints), though a pipeline's stages are gathered into
    OUT/global.safetensors as every run's model is: a --pp user looked for the model in the checkpoints."""
    said = next(line for line in train_help.splitlines() if line.strip().startswith("--out DIR"))
    assert "final model (train: also its checkpoints);" in said and "--pp" not in said, said


def test_a_bare_synthetic_dataset_trains_on_the_default_federation_as_the_help_offers(train_help, tmp_path, capfd):
    """--help offered synthetic[:ALPHA:BETA[:CLIENTS[:SAMPLES]]], but plain synthetic (and synthetic:iid) was refused
    for lacking CLIENTS, exit 2: train pools the clients, so a bare name is the generator's default of 100."""
    assert "synthetic[:ALPHA:BETA[:CLIENTS[:SAMPLES]]]" in " ".join(train_help.split()), train_help
    results = {}
    for name in ("synthetic", "synthetic:0.5:0.5:100", "synthetic:iid"):
        out = name.replace(":", "-")
        code, lines = _train_here(["--dataset", name, "--out", out], tmp_path, capfd)
        assert code == 0, lines
        summary = json.loads((tmp_path / out / "summary.json").read_text())
        assert (summary["dataset"], summary["steps"]) == (name, 2), summary
        results[name] = summary["test_loss"]
    assert results["synthetic"] == results["synthetic:0.5:0.5:100"], results  # the same data, the same seed
