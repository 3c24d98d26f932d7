"""A `fedpar train` checkpoint keeps its --batch-size: the resume's data position (the batch of the epoch it stopped
at) and the steps of --epochs count in batches of that size, so a resume with another one silently skipped or
repeated examples of that epoch (or found nothing left to train); it is refused in one line before any rank starts."""

from __future__ import annotations

import json

from fedpar.cli.main import main


def test_a_resume_with_another_batch_size_is_refused_and_the_same_one_resumes(tmp_path, capsys):
    out = tmp_path / "out"
    run = ["train", "--model", "mlp", "--dataset", "digits", "--device", "cpu", "--checkpoint-every", "2", "--no-plot",
           "--out", str(out)]
    assert main([*run, "--batch-size", "64", "--max-steps", "2"]) == 0
    capsys.readouterr()
    assert main([*run, "--batch-size", "128", "--max-steps", "4"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedpar train: cannot resume from ") and \
        "it was made with --batch-size 64, not 128;" in lines[0], lines
    assert json.loads((out / "summary.json").read_text())["steps"] == 2  # nothing ran
    assert main([*run, "--batch-size", "64", "--max-steps", "4"]) == 0
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 2
