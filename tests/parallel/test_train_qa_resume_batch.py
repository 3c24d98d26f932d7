"""A `fedpar train` checkpoint keeps its --batch-size and --seed: the resume's data position (the batch of the epoch it
stopped at) and the steps of --epochs count in batches of that size, in that seed's shuffle, so a resume with another
one silently skipped or repeated examples of that epoch (or found nothing left to train); it is refused in one line
before any rank starts."""

from __future__ import annotations

import json

import pytest

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


@pytest.mark.parametrize("first, other, said", [
    (["--batch-size", "64"], ["--batch-size", "32"], "--batch-size 64, not 32"),
    (["--seed", "0"], ["--seed", "1"], "--seed 0, not 1"),
])
def test_another_batch_size_or_seed_is_named(tmp_path, capsys, first, other, said):
    run = ["train", "--model", "mlp", "--dataset", "digits", "--device", "cpu", "--checkpoint-every", "2", "--no-plot",
           "--out", str(tmp_path / "out"), "--max-steps", "2"]
    assert main([*run, *first]) == 0
    capsys.readouterr()
    assert main([*run, *other]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"it was made with {said};" in lines[0], lines
