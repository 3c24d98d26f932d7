"""QA: `fedpar serve --aggregator-ranks N` forked N aggregator ranks whatever this machine's memory (up to 1024, each
about 60 MiB of its own and its copy of the model), so a huge N ran until the kernel's OOM killer stopped them; the
service (--state) started them too. Both are now one line, exit 2, before any rank starts (server/ranks/memory.py,
the estimate of `train --nproc`: parallel/preflight.py check_ranks_fit)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedpar.datasets.memory import available_bytes
from fedpar.security.certs import ensure_certs
from fedpar.server.ranks.memory import AGGREGATOR_BYTES_PER_PARAMETER, AGGREGATOR_RANK_BYTES
from support.devices import RANKS_ON_CPU
from support.in_process import run_main

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
RANKS = 1024  # the most --aggregator-ranks takes
PARAMS = 10_000_000  # the launcher builds it (120 MB for a moment); 1024 ranks of it need about 290 GiB
LINE = (r"fedpar serve: serving on 1024 aggregator ranks here \(--aggregator-ranks 1024\) needs about ([0-9.]+) GiB "
        r"of memory and this machine has ([0-9.]+) GiB available; give a smaller --aggregator-ranks, or launch the "
        r"ranks on several machines with torchrun")


def _needs(parameters: int) -> int:
    return RANKS * (AGGREGATOR_RANK_BYTES + AGGREGATOR_BYTES_PER_PARAMETER * parameters)


def _one_line(done) -> re.Match:
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    # --insecure's own warnings (logged) aside, one line
    line, = [line for line in done.stderr.splitlines() if line.strip() and " fedpar.security " not in line]
    match = re.fullmatch(LINE, line)
    assert match and float(match[1]) > float(match[2]), line
    return match


def test_more_aggregator_ranks_than_the_memory_holds_is_one_line_before_any_rank(tmp_path, capfd):
    free = available_bytes()
    if free is None or free > _needs(PARAMS):
        pytest.skip("this machine has memory for 1024 ranks of the model (or does not say)")
    out = tmp_path / "out"
    done = run_main(["serve", "--insecure", "--port", "0", "--aggregator-ranks", str(RANKS), "--model", "synthetic",
                     "--params", str(PARAMS), "--no-central-eval", "--rounds", "1", "--out", str(out), *RANKS_ON_CPU],
                    capfd, ROOT)
    match = _one_line(done)
    assert float(match[1]) >= _needs(PARAMS) / 2**30 - 0.1, match[0]  # the model's copies counted, not only ranks
    assert not out.exists()


def test_the_service_s_ranks_are_checked_before_they_start(tmp_path, capfd):
    free = available_bytes()
    if free is None or free > _needs(0):
        pytest.skip("this machine has memory for 1024 aggregator ranks (or does not say)")
    certs = tmp_path / "certs"
    ensure_certs(certs, ["a1"], ["127.0.0.1"], operators=["op"])
    state = tmp_path / "service.db"
    done = run_main(["serve", "--certs", str(certs), "--state", str(state), "--port", "0", "--control-port", "0",
                     "--aggregator-ranks", str(RANKS), *RANKS_ON_CPU], capfd, ROOT)
    _one_line(done)
    assert not state.exists()


def test_the_ranks_memory_check_does_not_import_torchs_pipelining_or_dtensor():
    # server/ranks/memory.py checks with parallel/preflight.py's estimate: importing the layouts' modules as well
    # cost every multi-rank serve and simulate 1.6 s of CPU (torch._dynamo, sympy) before its ranks started
    import subprocess
    import sys

    probe = ("import sys, fedpar.server.ranks.memory; print(sorted(m for m in ('torch._dynamo', "
             "'torch.distributed.pipelining', 'torch.distributed.tensor') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stderr
