"""`--task-option KEY=none` (any case) sets an option declared ``X | None`` to None (it was refused: "must be an
integer, got 'none'"), as a null kept in global.json rebuilds it; an option whose type does not allow None refuses
it in one line saying so, a str option keeps the text, and a choice named 'none' stays that choice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedpar.cli.main import main
from fedpar.tasks.reference import load_task
from fedpar.task import TaskError

TASK = '''
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from fedpar.tasks.zoo import classifier


@dataclass
class Options:
    limit: int | None = 5
    folder: Path | None = None
    note: str = "x"
    mode: Literal["none", "fast"] | None = "fast"
    hidden: int = 32


def task(options: Options):
    seen = {k: (None if v is None else str(v)) for k, v in asdict(options).items()}
    Path(__file__).with_suffix(".seen").write_text(json.dumps(seen))
    return classifier(model="mlp", dataset="digits")


def plain(limit: float | None = 1.0, hidden: int = 3):
    Path(__file__).with_suffix(".seen").write_text(json.dumps({"limit": limit, "hidden": hidden}))
    return classifier(model="mlp", dataset="digits")
'''


@pytest.fixture
def task_file(tmp_path: Path) -> Path:
    path = tmp_path / "opt_task.py"
    path.write_text(TASK)
    return path


def _seen(task_file: Path) -> dict:
    return json.loads(task_file.with_suffix(".seen").read_text())


def test_train_sets_an_optional_task_option_to_none(tmp_path, task_file):
    run = subprocess.run([sys.executable, "-m", "fedpar", "train", "--task", f"{task_file}:task", "--task-option",
                          "limit=NONE", "--task-option", "folder=none", "--task-option", "note=none",
                          "--task-option", "mode=none", "--max-steps", "2", "--device", "cpu", "--no-plot", "--out",
                          str(tmp_path / "out")], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    # note is a str (the text stays); mode's choices include 'none', which stays that choice
    assert _seen(task_file) == {"limit": None, "folder": None, "note": "none", "mode": "none", "hidden": "32"}


def test_keyword_parameters_and_a_kept_null_take_none(task_file):
    load_task(f"{task_file}:plain", {"limit": " None "})
    assert _seen(task_file) == {"limit": None, "hidden": 3}
    load_task(f"{task_file}:task", {"limit": None})  # global.json keeps None as null
    assert _seen(task_file)["limit"] is None


def test_an_option_that_does_not_allow_none_refuses_it_in_one_line(tmp_path, task_file, capsys):
    code = main(["train", "--task", f"{task_file}:task", "--task-option", "hidden=none", "--max-steps", "2",
                 "--device", "cpu", "--no-plot", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == (
        f"fedpar train: --task {task_file}:task: option 'hidden' cannot be none: it is declared int, not int | None; "
        "give a value, or leave the option out for its default"), err
    with pytest.raises(TaskError, match=r"option 'hidden' cannot be none"):
        load_task(f"{task_file}:plain", {"hidden": "none"})
    with pytest.raises(TaskError, match=r"its options: limit \(float or none, default 1.0\); hidden \(int, default 3\)"):
        load_task(f"{task_file}:plain", {"bogus": "1"})
