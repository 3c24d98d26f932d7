"""Two Flower Apps whose packages share a name (as two apps made by `flwr new` with one name do), loaded in one
process (a notebook, a program using the Python API): the second ran the first one's code, without a word (QA)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_the_second_of_two_apps_of_one_package_name_runs_its_own_code(tmp_path):
    pytest.importorskip("flwr")
    from fedpar.tasks.flower_app import load_flower_app

    for name in ("a", "b"):
        shutil.copytree(HERE / "tiny_app", tmp_path / name)
        with (tmp_path / name / "tiny_flower_app" / "server_app.py").open("a") as fh:
            fh.write(f"\nMARK = {name!r}\n")
    try:
        marks = []
        for name in ("a", "b", "a"):
            load_flower_app(tmp_path / name).server_app
            module = sys.modules["tiny_flower_app.server_app"]
            assert Path(module.__file__).is_relative_to(tmp_path / name), module.__file__
            marks.append(module.MARK)
        assert marks == ["a", "b", "a"]
    finally:  # the copies' package is not left for the tests after this one to import
        for module in [m for m in sys.modules if m.split(".")[0] == "tiny_flower_app"]:
            del sys.modules[module]
        sys.path[:] = [p for p in sys.path if not Path(p).is_relative_to(tmp_path)]
