"""QA: `fedpar simulate --aggregator-ranks N` started N-1 aggregator ranks beside its coordinator whatever this machine's
memory (up to 1024, each about 60 MiB of its own), while `fedpar serve --aggregator-ranks N` refused a layout that
cannot fit; simulate now says it in the same one line, exit 2, before its child or any rank starts (server/ranks/
memory.py check_aggregator_ranks_fit, called once in cli/simulate.py launch_checked)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedpar.datasets.memory import available_bytes
from fedpar.server.ranks.memory import AGGREGATOR_RANK_BYTES
from support.in_process import run_main

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
RANKS = 1024  # the most --aggregator-ranks takes: 64 GiB of ranks before any model
LINE = (r"fedpar simulate: serving on 1024 aggregator ranks here \(--aggregator-ranks 1024\) needs about ([0-9.]+) GiB "
        r"of memory and this machine has ([0-9.]+) GiB available; give a smaller --aggregator-ranks")


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint-dir"])
def test_more_aggregator_ranks_than_the_memory_holds_is_one_line_before_any_rank(tmp_path, capfd, checkpoint):
    free = available_bytes()
    if free is None or free > RANKS * AGGREGATOR_RANK_BYTES:
        pytest.skip("this machine has memory for 1024 aggregator ranks (or does not say)")
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    done = run_main(["simulate", "--clients", "2", "--rounds", "1", "--aggregator-ranks", str(RANKS),
                     "--out", str(out), *(["--checkpoint-dir", str(ckpt)] if checkpoint else [])], capfd, ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    line, = [line for line in done.stderr.splitlines() if line.strip()]
    match = re.fullmatch(LINE, line)
    assert match and float(match[1]) > float(match[2]), line
    assert float(match[1]) >= RANKS * AGGREGATOR_RANK_BYTES / 2**30 - 0.1, line
    assert not ckpt.exists()  # the checkpoint folder it made for its lock is taken away
    assert not (out / "metrics.jsonl").exists()
