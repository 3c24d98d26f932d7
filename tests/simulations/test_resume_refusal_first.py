"""A resume of `fedpar simulate --checkpoint-dir` that will be refused says only its refusal (QA: with --privacy
central over a checkpoint made without it, it first said what the resume changed, then, once the coordinator had
loaded the data, refused the strategy)."""

from __future__ import annotations

import subprocess
import sys

SIMULATE = [sys.executable, "-m", "fedpar", "simulate", "--clients", "6", "--clients-per-round", "4", "--quiet",
            "--checkpoint-dir", "D", "--out", "O"]


def test_a_resume_with_another_strategy_says_only_its_refusal(tmp_path):
    made = subprocess.run(SIMULATE + ["--rounds", "1", "--secure-aggregation"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=240)
    assert made.returncode == 0, made.stderr
    done = subprocess.run(SIMULATE + ["--rounds", "2", "--privacy", "central"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.splitlines() == ["fedpar simulate: checkpoint in D was made with strategy 'fedavg', not "
                                        "'dp-fedavg'; resume with the --strategy (and --privacy) it was made with, or "
                                        "point --checkpoint-dir elsewhere"], done.stderr
