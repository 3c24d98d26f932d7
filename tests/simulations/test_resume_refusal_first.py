"""A resume of `fedpar simulate --checkpoint-dir` that will be refused says only its refusal (QA: with --privacy
central over a checkpoint made without it, it first said what the resume changed, then, once the coordinator had
loaded the data, refused the strategy)."""

from __future__ import annotations

import pytest

from support.in_process import run_main

# Run by its main in this process (support.in_process.run_main): what a refusal says, and where (the launcher or the
# coordinator process it starts: capfd holds both's stdout and stderr), is what a process's would be, without the
# process's seconds of imports.
SIMULATE = ["simulate", "--clients", "6", "--clients-per-round", "4", "--quiet", "--checkpoint-dir", "D", "--out", "O"]


def test_a_resume_with_another_strategy_says_only_its_refusal(tmp_path, capfd):
    made = run_main(SIMULATE + ["--rounds", "1", "--secure-aggregation"], capfd, tmp_path)
    assert made.returncode == 0, made.stderr
    done = run_main(SIMULATE + ["--rounds", "2", "--privacy", "central"], capfd, tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.splitlines() == ["fedpar simulate: checkpoint in D was made with strategy 'fedavg', not "
                                        "'dp-fedavg'; resume with the --strategy (and --privacy) it was made with, or "
                                        "point --checkpoint-dir elsewhere"], done.stderr


def test_a_resume_of_a_damaged_checkpoint_says_only_its_refusal_and_keeps_the_outputs(tmp_path, capfd):
    """QA: with --lr changed, a resume whose latest checkpoint had lost its global.safetensors first said 'resuming
    ... with --lr 0.05', then, from the coordinator, that it cannot resume."""
    made = run_main(SIMULATE + ["--rounds", "2"], capfd, tmp_path)
    assert made.returncode == 0, made.stderr
    (tmp_path / "D" / "round-000002" / "global.safetensors").write_bytes(b"\0" * 100)
    rows, record = (tmp_path / "O" / "metrics.jsonl").read_text(), (tmp_path / "D" / "run.json").read_text()
    done = run_main(SIMULATE + ["--rounds", "3", "--lr", "0.05"], capfd, tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("fedpar simulate: cannot resume: damaged checkpoint: D/round-000002/global.safetensors: "
                           "not a safetensors file") and line.endswith(
        "to resume from the previous checkpoint instead, write 'round-000001' into D/LATEST (the rounds after it run "
        "again)"), line
    assert (tmp_path / "O" / "metrics.jsonl").read_text() == rows and (tmp_path / "D" / "run.json").read_text() == record


def test_a_resume_with_another_flower_strategy_says_only_its_refusal(tmp_path, capfd):
    """QA: over a checkpoint of flower:...:FedAvgM with a server momentum, flower:...:FedAdam first said 'resuming ...
    with --strategy-option {}', then, from the coordinator, refused the strategy."""
    pytest.importorskip("flwr")
    flower = "flower:flwr.server.strategy:"
    made = run_main(SIMULATE + ["--rounds", "1", "--strategy", f"{flower}FedAvgM", "--strategy-option",
                                "server_momentum=0.5"], capfd, tmp_path)
    assert made.returncode == 0, made.stderr
    done = run_main(SIMULATE + ["--rounds", "2", "--strategy", f"{flower}FedAdam"], capfd, tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.splitlines() == [f"fedpar simulate: checkpoint in D was made with strategy '{flower}FedAvgM', "
                                        f"not '{flower}FedAdam'; resume with the --strategy (and --privacy) it was "
                                        "made with, or point --checkpoint-dir elsewhere"], done.stderr
