"""A Flower App whose ``[tool.fedpar] train-examples`` function raises, run by ``fedpar simulate --flower-app`` with
real worker processes over loopback gRPC: under fedpar's strategy the run stops in one line; when the app's own
ServerApp drives, fedpar does not call it (the ServerApp weighs its replies itself) and the run goes on."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")

APP = Path(__file__).parent / "tiny_app"
PARTS = '''
from flwr.app import Array, ArrayRecord

from tiny_flower_app.task import initial_arrays


def model():
    return ArrayRecord({name: Array(a) for name, a in initial_arrays().items()})


def size(partition_id, num_partitions):
    raise RuntimeError("the partition index file is missing")
'''


@pytest.fixture()
def app(tmp_path):
    copy = tmp_path / "app"
    shutil.copytree(APP, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "tiny_flower_app" / "fedpar_parts.py").write_text(PARTS)
    with (copy / "pyproject.toml").open("a") as f:
        f.write('\n[tool.fedpar]\nmodel = "tiny_flower_app.fedpar_parts:model"\n'
                'train-examples = "tiny_flower_app.fedpar_parts:size"\n')
    return copy


def simulate(app, tmp_path, *options):
    return subprocess.run([sys.executable, "-m", "fedpar", "simulate", "--flower-app", str(app), "--clients", "2",
                           "--workers", "1", "--run-config", "num-server-rounds=1", *options, "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)


def test_train_examples_that_raise_stop_a_fedpar_driven_run_in_one_line(app, tmp_path):
    """The worker died with a traceback and the run said 'worker process died ...: run the same command again'
    (QA)."""
    done = simulate(app, tmp_path, "--strategy", "fedavg", "--rounds", "1")
    lines = [line for line in done.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1].startswith(f"fedpar simulate: {app}: [tool.fedpar] train-examples raised RuntimeError: the "
                                "partition index file is missing for client-000"), done.stderr[-3000:]
    assert lines[-1].endswith(f": fix the app ({app})"), lines[-1]  # it said 'fix the task (None)'


def test_a_server_app_run_does_not_call_train_examples(app, tmp_path):
    """Its worker called it, died with a traceback, and the run stopped (QA)."""
    done = simulate(app, tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
