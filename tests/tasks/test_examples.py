"""examples/own_task.py, as the own-task tutorial (docs/tutorials/your-own-task.md) runs it: a user's own model and CSV table (examples/table.csv) federated by
`fedpar simulate`, the same task trained centrally by `fedpar train` as its baseline, and served to agents by
`fedpar serve`/`client`; its typed options as global.json keeps them."""

from __future__ import annotations

import json
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from fedpar.cli.main import main
from fedpar.tasks.reference import load_task
from support.in_process import logging_as_a_fresh_process
from support.own_task import EXAMPLE, write_table

FEDPAR = [sys.executable, "-m", "fedpar.cli.main"]
ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "examples" / "table.csv"


def _tutorial_commands(subcommand: str) -> list[list[str]]:
    """The tutorial's `.venv/bin/fedpar SUBCOMMAND --task examples/own_task.py:task ...` lines, as argument lists."""
    readme = (ROOT / "docs" / "tutorials" / "your-own-task.md").read_text()
    lines = [line.split("  #")[0] for line in readme.splitlines()
             if line.startswith(f".venv/bin/fedpar {subcommand} ") and "examples/own_task.py:task" in line
             and not line.rstrip().endswith("...")]
    return [shlex.split(line)[1:] for line in lines]


def _fedpar(args: list[str], capfd) -> None:
    """`fedpar ARGS` as the `fedpar` command runs it (its main), in this process, from the current directory; its
    output and its processes' (file descriptors 1 and 2, its log included) hold no traceback."""
    with logging_as_a_fresh_process():
        code = main(args)
    out, err = capfd.readouterr()
    assert code == 0 and "Traceback" not in err, (args, out[-2000:], err[-3000:])


def test_the_tutorials_own_task_commands_run_as_written_from_the_repository_root(tmp_path, capfd, monkeypatch):
    """The own-task tutorial's simulate and train lines of examples/own_task.py, on the examples/table.csv that ships, learn:
    the federation and its centralized baseline both classify the held-out wines."""
    (simulate,), (train,) = _tutorial_commands("simulate"), _tutorial_commands("train")
    assert "csv=examples/table.csv" in simulate and "csv=examples/table.csv" in train
    fl, central = tmp_path / "fl", tmp_path / "central"
    monkeypatch.chdir(ROOT)  # the tutorial's relative paths, as from the repository root
    _fedpar([*simulate, "--out", str(fl)], capfd)
    rows = [json.loads(line) for line in (fl / "metrics.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["ok"] * 5 and all(r["reported"] == 4 for r in rows)
    assert rows[-1]["test_accuracy"] > 0.8 and rows[-1]["test_loss"] < 0.5  # 3 cultivars: chance is 0.4
    assert "federated_eval_accuracy" in rows[-1]  # the agents' validation shares, scored by the task
    config = json.loads((fl / "summary.json").read_text())["config"]
    assert config["task"] and not {"dataset", "model"} & config.keys()  # the task's, not the zoo's defaults (QA)

    _fedpar([*train, "--out", str(central)], capfd)
    summary = json.loads((central / "summary.json").read_text())
    assert summary["epochs"] == 5 and summary["test_accuracy"] > 0.8
    assert not {"dataset", "model", "data_path"} & summary["config"].keys()  # the task's, not the zoo's defaults
    records = [json.loads(line) for line in (central / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["train", "eval"] * 5
    # One definition: the baseline's model has the federated model's layout, name by name.
    fl_model, central_model = load_file(fl / "global.safetensors"), load_file(central / "global.safetensors")
    assert {k: v.shape for k, v in fl_model.items()} == {k: v.shape for k, v in central_model.items()}


def test_the_shipped_table_is_what_make_table_writes(tmp_path):
    example = runpy.run_path(str(ROOT / "examples" / "make_table.py"))
    made, shipped = (path.read_text().splitlines() for path in (example["write_table"](tmp_path / "t.csv"), TABLE))
    assert made[0] == shipped[0] and shipped[0].endswith(",label") and len(shipped) == 179
    made_rows, shipped_rows = (np.array([line.split(",") for line in lines[1:]], float) for lines in (made, shipped))
    assert np.array_equal(made_rows[:, -1], shipped_rows[:, -1])  # the labels
    assert np.abs(made_rows - shipped_rows).max() <= 0.0011  # the features, to their 3 decimals


def _typed(description: dict) -> dict:
    return {k: (type(v).__name__, v) for k, v in description["task_options"].items()}


def test_own_task_options_stay_typed_in_global_json_and_rebuild_its_model(tmp_path, capsys):
    """`--task-option hidden=64 weight_decay=0.01` are kept in global.json as 64 and 0.01 (simulate and train), and
    global.json's model rebuilds the task, whose model takes global.safetensors; export reads the run."""
    options = ["--task", EXAMPLE, "--task-option", f"csv={TABLE}", "--task-option", "hidden=64",
               "--task-option", "weight-decay=0.01"]
    expected = {"csv": ("str", str(TABLE)), "hidden": ("int", 64), "weight_decay": ("float", 0.01)}
    fl, central = tmp_path / "fl", tmp_path / "central"
    assert main(["simulate", *options, "--clients", "2", "--rounds", "1", "--workers", "1", "--quiet",
                 "--out", str(fl)]) == 0
    assert main(["train", *options, "--epochs", "1", "--no-plot", "--out", str(central)]) == 0
    for out in (fl, central):
        model = json.loads((out / "global.json").read_text())["model"]
        assert model["task"] == EXAMPLE and _typed(model) == expected, model
        rebuilt = load_task(model["task"], model["task_options"]).model()
        rebuilt.load_state_dict({k: torch.from_numpy(v) for k, v in load_file(out / "global.safetensors").items()})
        assert rebuilt[0].out_features == 64
    assert main(["export", str(fl), "--to", str(tmp_path / "model.pt")]) == 0
    assert torch.load(tmp_path / "model.pt", weights_only=True)["0.weight"].shape == (64, 13)
    capsys.readouterr()


def test_global_json_rebuilds_the_task_from_another_folder_when_its_options_were_relative(tmp_path, monkeypatch,
                                                                                          capsys):
    """As the guide runs it, from the repository root with `csv=examples/table.csv`: global.json keeps the table's
    path absolute, as the task's, so the guide's `load_task(model["task"], model["task_options"])` rebuilds the task
    from any folder (it read 'examples/table.csv' and raised FileNotFoundError elsewhere)."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "central"
    assert main(["train", "--task", "examples/own_task.py:task", "--task-option", "csv=examples/table.csv",
                 "--task-option", "hidden=16", "--epochs", "1", "--no-plot", "--out", str(out)]) == 0
    model = json.loads((out / "global.json").read_text())["model"]
    assert model == {"task": EXAMPLE, "task_options": {"csv": str(TABLE), "hidden": 16}}, model
    monkeypatch.chdir(tmp_path)
    rebuilt = load_task(model["task"], model["task_options"]).model()
    rebuilt.load_state_dict({k: torch.from_numpy(v) for k, v in load_file(out / "global.safetensors").items()})
    assert rebuilt[0].out_features == 16
    capsys.readouterr()


def test_a_bool_option_stays_a_bool_and_a_path_its_text():
    task_file = ROOT / "tests" / "support" / "flagged_task.py"
    description = load_task(f"{task_file}:task", {"wide": "true", "scale": "2", "notes": "a/b.txt"}).description
    assert _typed(description) == {"wide": ("bool", True), "scale": ("float", 2.0), "notes": ("str", "a/b.txt")}
    json.dumps(description)  # as global.json writes it
    # Typed values (global.json's, or a TOML table's) are taken as they are.
    again = load_task(f"{task_file}:task", description["task_options"]).description
    assert again == description


def _serve_with_one_agent(task: list[str], rounds: int, out: Path, checkpoints: Path, capsys) -> str:
    """`fedpar serve` of ``task`` for ``rounds`` rounds (resuming from ``checkpoints``) and one `fedpar client` of it
    (the client's main, in this process); returns the client's output."""
    serve = subprocess.Popen([*FEDPAR, "serve", "--insecure", "--port", "0", *task, "--min-available", "1",
                              "--clients-per-round", "1", "--rounds", str(rounds), "--local-epochs", "1",
                              "--lr", "0.01", "--checkpoint-dir", str(checkpoints), "--out", str(out)],
                             cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    threads = torch.get_num_threads()
    try:
        lines = []
        for line in serve.stdout:
            lines.append(line)
            if match := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
                break
        assert match, "".join(lines)
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(out.parent)
            code = main(["client", "--insecure", "--server", f"127.0.0.1:{match.group(1)}", *task,
                         "--agent-id", "alice", "--threads", "1", "--give-up-after", "30"])
        client_out, client_err = capsys.readouterr()
        serve_out = serve.communicate(timeout=60)[0]
    finally:
        torch.set_num_threads(threads)  # --threads 1 set this process's torch threads
        if serve.poll() is None:
            serve.kill()
    assert code == 0, client_out + client_err
    assert serve.returncode == 0, serve_out
    return client_out


def test_own_task_served_to_a_client_agent_and_resumed_keeps_its_typed_options(tmp_path, capsys):
    csv = write_table(tmp_path / "table.csv")
    task = ["--task", EXAMPLE, "--task-option", f"csv={csv}", "--task-option", "hidden=8"]
    out, checkpoints = tmp_path / "run", tmp_path / "checkpoints"
    assert "2 updates accepted, 0 refused" in _serve_with_one_agent(task, 2, out, checkpoints, capsys)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["ok", "ok"] and "test_accuracy" in rows[-1]
    # Restarted with one more round: it resumes from round 2, and its global.json keeps the options typed.
    assert "1 update accepted, 0 refused" in _serve_with_one_agent(task, 3, out, checkpoints, capsys)
    info = json.loads((out / "global.json").read_text())
    assert info["round"] == 3 and info["model"] == {"task": EXAMPLE, "task_options": {"csv": str(csv), "hidden": 8}}


def test_a_federation_in_python_without_the_cli():
    example = runpy.run_path(str(ROOT / "examples" / "in_python.py"))
    rows = example["run"](rounds=2)
    assert [(r["round"], r["status"], r["reported"]) for r in rows] == [(1, "ok", 2), (2, "ok", 2)]
    assert rows[-1]["test_accuracy"] > 0.5
