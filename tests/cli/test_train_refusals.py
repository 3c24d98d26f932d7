"""`fedpar train` as a new user misuses it, each command a real process: a mistake is one line saying what to do,
exit code 2, and loses nothing already written (QA)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FEDPAR = [sys.executable, "-m", "fedpar.cli.main"]


def _train(args: list[str], cwd: Path) -> tuple[int, list[str]]:
    """``fedpar train ARGS`` (2 steps of the mlp on digits, on the CPU) in ``cwd``: its exit code and stderr lines."""
    done = subprocess.run([*FEDPAR, "train", "--max-steps", "2", "--device", "cpu", "--no-plot", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stderr.splitlines()


@pytest.mark.parametrize("written, table", [("[train]\nmodel_kwargs = 3\n", "[train.model_kwargs]"),
                                            ("model_kwargs = [1, 2]\n", "[model_kwargs]")])
def test_model_kwargs_in_a_config_file_that_is_no_table_is_one_line(written, table, tmp_path):
    """It was a TypeError's traceback, exit 1."""
    (tmp_path / "run.toml").write_text(written)
    code, lines = _train(["--config", "run.toml", "--out", "out"], tmp_path)
    assert (code, len(lines)) == (2, 1), lines
    assert lines[0].startswith(f"fedpar train: run.toml: model_kwargs: expected a table ({table} with a KEY = VALUE "
                               "line each), got "), lines
    assert not (tmp_path / "out").exists()
