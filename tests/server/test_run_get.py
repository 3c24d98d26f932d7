"""`fedpar run get` of a run that left no model (stopped while it waited for agents: 0 rounds, only its summary) is
one line and exit 2, and writes nothing, as the docs say and as for a run stopped while still queued (it wrote
r1/summary.json and exited 0); a run that left its model is written as before. A real control API over a run store
whose runs' folders hold what a service leaves, and real `fedpar run` processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import safetensors.numpy

from fedpar.server.run_store import RunStore
from support.control_api import control_api

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def control(tmp_path):
    with control_api(tmp_path) as (store, options, _, _):
        yield store, options


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedpar", "run", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def _ended_run(store: RunStore, folder: Path, status: str, files: dict[str, bytes], reason: str = "") -> int:
    """A run that started in ``folder``, left ``files`` there and ended ``status``."""
    run_id = store.submit(status, {"rounds": 1}, who="op")
    folder.mkdir()
    store.start(run_id, str(folder))
    for name, data in files.items():
        (folder / name).write_bytes(data)
    model = folder / "global.safetensors"
    store.end(run_id, status, reason, str(model) if model.exists() else "")
    return run_id


def test_get_of_a_run_stopped_before_its_first_round_is_one_line_and_writes_nothing(control, tmp_path):
    store, options = control
    summary = json.dumps({"rounds": 0, "interrupted": True}).encode()
    run_id = _ended_run(store, tmp_path / "run-1", "stopped", {"summary.json": summary}, "stopped after round 0")
    for out in (tmp_path / "r1", tmp_path / "there"):  # a folder to make, and one that is there (and stays)
        there = out.name == "there"
        if there:
            out.mkdir()
        done = _run("get", str(run_id), "--out", str(out), *options)
        assert done.returncode == 2 and done.stdout == "", done
        assert done.stderr.splitlines() == [
            f"fedpar run: run {run_id} is stopped with no model to get: no round of it completed (stopped after "
            f"round 0); 'fedpar run logs {run_id}' shows what it did"], done.stderr
        assert (out.is_dir() and not any(out.iterdir())) if there else not out.exists()


def test_get_of_a_run_that_left_its_model_writes_its_files(control, tmp_path):
    store, options = control
    model = safetensors.numpy.save({"w": numpy.arange(4, dtype=numpy.float32)})  # a model that parses (it is checked)
    files = {"global.safetensors": model, "global.json": b"{}", "summary.json": b'{"rounds": 1}'}
    run_id = _ended_run(store, tmp_path / "run-1", "finished", files)
    out = tmp_path / "got"
    done = _run("get", str(run_id), "--out", str(out), *options)
    assert done.returncode == 0 and done.stderr == "", done
    assert sorted(p.name for p in out.iterdir()) == sorted(files)
    assert all((out / name).read_bytes() == data for name, data in files.items())
