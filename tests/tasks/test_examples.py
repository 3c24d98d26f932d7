"""examples/own_task.py, as the README runs it: a user's own model and CSV table federated by `fedpar simulate`, the
same task trained centrally by `fedpar train` as its baseline, and served to agents by `fedpar serve`/`client`."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from safetensors.numpy import load_file

from fedpar.cli.main import main
from support.own_task import EXAMPLE, write_table

FEDPAR = [sys.executable, "-m", "fedpar.cli.main"]


def test_own_task_federated_and_its_centralized_baseline(tmp_path, capsys):
    csv = write_table(tmp_path / "table.csv")
    fl, central = tmp_path / "fl", tmp_path / "central"
    assert main(["simulate", "--task", EXAMPLE, "--task-option", f"csv={csv}", "--task-option", "hidden=16",
                 "--clients", "3", "--rounds", "3", "--workers", "1", "--local-epochs", "2", "--lr", "0.01",
                 "--quiet", "--out", str(fl)]) == 0
    rows = [json.loads(line) for line in (fl / "metrics.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["ok"] * 3 and all(r["reported"] == 3 for r in rows)
    assert rows[-1]["test_accuracy"] > 0.6 and rows[-1]["test_loss"] < rows[0]["test_loss"]
    assert "federated_eval_accuracy" in rows[-1]  # the agents' validation shares, scored by the task
    info = json.loads((fl / "global.json").read_text())
    assert info["model"] == {"task": EXAMPLE, "task_options": {"csv": str(csv), "hidden": "16"}}

    assert main(["train", "--task", EXAMPLE, "--task-option", f"csv={csv}", "--task-option", "hidden=16",
                 "--epochs", "4", "--lr", "0.01", "--batch-size", "16", "--no-plot", "--out", str(central)]) == 0
    summary = json.loads((central / "summary.json").read_text())
    assert summary["epochs"] == 4 and summary["test_accuracy"] > 0.6
    records = [json.loads(line) for line in (central / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["train", "eval"] * 4
    # One definition: the baseline's model has the federated model's layout, name by name.
    fl_model, central_model = load_file(fl / "global.safetensors"), load_file(central / "global.safetensors")
    assert {k: v.shape for k, v in fl_model.items()} == {k: v.shape for k, v in central_model.items()}
    capsys.readouterr()


def test_own_task_served_to_a_client_agent(tmp_path):
    csv = write_table(tmp_path / "table.csv")
    task = ["--task", EXAMPLE, "--task-option", f"csv={csv}"]
    serve = subprocess.Popen([*FEDPAR, "serve", "--insecure", "--port", "0", *task, "--min-available", "1",
                              "--clients-per-round", "1", "--rounds", "2", "--local-epochs", "1", "--lr", "0.01",
                              "--out", str(tmp_path / "run")],
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = None
    try:
        lines = []
        for line in serve.stdout:
            lines.append(line)
            if match := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
                break
        assert match, "".join(lines)
        client = subprocess.run([*FEDPAR, "client", "--insecure", "--server", f"127.0.0.1:{match.group(1)}", *task,
                                 "--agent-id", "alice", "--threads", "1", "--give-up-after", "30"],
                                cwd=tmp_path, capture_output=True, text=True, timeout=120)
        serve_out = serve.communicate(timeout=60)[0]
    finally:
        if serve.poll() is None:
            serve.kill()
    assert client.returncode == 0 and "2 updates accepted, 0 refused" in client.stdout, client.stdout + client.stderr
    assert serve.returncode == 0, serve_out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["ok", "ok"] and "test_accuracy" in rows[-1]


def test_a_federation_in_python_without_the_cli():
    import runpy
    from pathlib import Path

    example = runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "in_python.py"))
    rows = example["run"](rounds=2)
    assert [(r["round"], r["status"], r["reported"]) for r in rows] == [(1, "ok", 2), (2, "ok", 2)]
    assert rows[-1]["test_accuracy"] > 0.5
