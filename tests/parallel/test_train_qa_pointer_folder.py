"""OUT/checkpoints/latest that is a folder (a checkpoint copied there by hand): `fedpar train` says so in one line
before any step, not after training up to its first checkpoint (one rank: its OSError; two: rank 0 failed)."""

from __future__ import annotations

import pytest

from support.in_process import run_main

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("extra", [["--checkpoint-every", "1"], []])
def test_a_latest_folder_is_said_before_any_step(tmp_path, capfd, extra):
    out = tmp_path / "run"
    (out / "checkpoints" / "latest").mkdir(parents=True)
    done = run_main(["train", "--model", "mlp", "--dataset", "digits", "--device", "cpu", "--max-steps", "2",
                     "--no-plot", "--out", str(out), *extra], capfd)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr and "step 1" not in done.stdout
    assert str(out / "checkpoints" / "latest") in lines[0] and "is a folder" in lines[0]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["latest"]  # nothing trained, nothing kept


def test_with_no_resume_and_no_checkpoints_the_folder_is_not_in_the_way(tmp_path, capfd):
    out = tmp_path / "run"
    (out / "checkpoints" / "latest").mkdir(parents=True)
    done = run_main(["train", "--model", "mlp", "--dataset", "digits", "--device", "cpu", "--max-steps", "1",
                     "--no-plot", "--no-resume", "--out", str(out)], capfd)
    assert done.returncode == 0, done.stderr
