"""`fedpar train` stopped in its start-up (settings, data, the task's own set-up), before any step: it said only
'fedpar train: interrupted', and not whether the same command would resume (QA). Here the task's factory is where
the Ctrl-C lands (it raises KeyboardInterrupt as Python does on SIGINT)."""

from __future__ import annotations

import signal

import pytest

from support.in_process import run_main

STOPPED = """
def task(**options):
    raise KeyboardInterrupt  # Ctrl-C while the task sets itself up (e.g. reads its data)
"""


@pytest.mark.parametrize("kept, flags, then", [
    (None, [], "the same command starts it again"),
    ("epoch-000002", [], "the same command resumes from its checkpoint epoch-000002"),
    ("epoch-000002", ["--no-resume"],
     "the same command starts it afresh (without --no-resume it resumes from its checkpoint epoch-000002)"),
])
def test_a_stop_in_trains_start_up_says_it_wrote_nothing_and_what_the_same_command_does(kept, flags, then, tmp_path,
                                                                                          capfd):
    (tmp_path / "stopped.py").write_text(STOPPED)
    if kept is not None:
        (tmp_path / "out" / "checkpoints").mkdir(parents=True)
        (tmp_path / "out" / "checkpoints" / "latest").write_text(kept + "\n")
    done = run_main(["train", "--task", "stopped.py:task", "--out", "out", *flags], capfd, cwd=tmp_path)
    assert done.returncode == 128 + signal.SIGINT and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"fedpar train: interrupted while starting, before any step; wrote nothing to out; {then}"), done.stderr
    left = sorted(p.name for p in (tmp_path / "out").iterdir()) if (tmp_path / "out").exists() else []
    assert left == (["checkpoints"] if kept else []), left  # a folder the run made for nothing is not left
