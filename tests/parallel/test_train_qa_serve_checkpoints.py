"""`fedpar train` pointed at a federated run's checkpoints (`fedpar serve --checkpoint-dir`) refuses in one line,
before it writes: its own checkpoints beside them left `fedpar serve` unable to resume that run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedpar.server.checkpoint import Checkpoint, check_checkpoint_dir, latest_round, save_checkpoint
from support.in_process import run_main

pytestmark = pytest.mark.timeout(120)


def _federated_checkpoints(folder: Path) -> None:
    save_checkpoint(folder, Checkpoint(3, ["w"], [np.zeros(3, np.float32)], {}, {}))


@pytest.mark.parametrize("where", ["checkpoints", "."])
def test_a_federated_runs_checkpoints_are_refused_and_left_as_they_were(tmp_path, capfd, where):
    out = tmp_path / "run"
    served = (out / where).resolve()
    _federated_checkpoints(served)
    before = sorted(p.name for p in served.iterdir())
    done = run_main(["train", "--model", "mlp", "--dataset", "digits", "--device", "cpu", "--max-steps", "2",
                     "--checkpoint-every", "1", "--no-plot", "--out", str(out)], capfd)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert "federated" in lines[0] and str(served) in lines[0] and "--out" in lines[0]
    assert sorted(p.name for p in served.iterdir()) == before
    check_checkpoint_dir(served)  # serve still takes the folder, and resumes from its round
    assert latest_round(served) == 3
