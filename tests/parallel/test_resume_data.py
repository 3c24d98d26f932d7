"""A `fedpar train` checkpoint keeps what its data told the model (a text's vocabulary), so a resume on another
--data-path is refused in one line before any rank starts (QA: rank 0's DCP load failed with 'Size mismatch ...'
after the ranks started, and its advice, to resume the checkpoint before, failed the same way)."""

from __future__ import annotations

import random

from fedpar.cli.main import main


def _text(path, alphabet: str) -> str:
    rng = random.Random(0)
    path.write_text("".join(rng.choice(alphabet) for _ in range(20_000)))
    return str(path)


def test_a_resume_on_a_text_of_another_vocabulary_is_refused_before_any_rank_starts(tmp_path, capsys):
    first, other = _text(tmp_path / "a.txt", "abcdefgh \n"), _text(tmp_path / "b.txt", "abcdefghijklmnop \n")
    run = ["train", "--model", "gpt", "--dataset", "text", "--checkpoint-every", "1", "--no-plot", "--out",
           str(tmp_path / "out")]
    assert main([*run, "--data-path", first, "--max-steps", "2"]) == 0
    capsys.readouterr()
    assert main([*run, "--data-path", other, "--max-steps", "3"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedpar train: cannot resume from ") and \
        "it was made with --data-path block_size=64 vocab_size=10, not block_size=64 vocab_size=18" in lines[0], lines
    assert main([*run, "--data-path", first, "--max-steps", "3"]) == 0  # the same data resumes


def test_a_resume_on_another_dataset_names_the_dataset_alone(tmp_path, capsys):
    """QA: the data's shape came beside it, labelled --data-path (which neither run gave)."""
    run = ["train", "--checkpoint-every", "1", "--no-plot", "--out", str(tmp_path / "out"), "--max-steps", "2"]
    assert main([*run, "--dataset", "digits"]) == 0
    capsys.readouterr()
    assert main([*run, "--dataset", "synthetic"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "it was made with --dataset digits, not synthetic; run with those settings" in lines[0] \
        and "--data-path" not in lines[0], lines
