"""QA: `fedpar train --nproc N` started N ranks whatever this machine's memory (up to 1024: 256 digits ranks took
6.5 GiB before any of them had trained, 1024 need about 100 GiB), and a model whose weights and optimizer state do not
fit went on until the kernel killed it. Both are said in one line, exit 2, before any rank starts or anything is
written."""

from __future__ import annotations

import math
import re

import pytest

from fedpar.datasets.memory import available_bytes
from fedpar.parallel.preflight import RANK_BYTES
from support.in_process import run_main

pytestmark = pytest.mark.timeout(120)

# two hidden layers of 10^6: 10^12 parameters, about 15 TiB of fp32 state on each rank
HUGE = ["--model-arg", "hidden=[1000000,1000000]"]


@pytest.mark.parametrize("nproc, said", [("1", "training in this process needs about "),
                                         ("2", "training on 2 ranks here (--nproc 2) needs about ")])
def test_a_model_whose_state_does_not_fit_is_one_line_before_any_rank(tmp_path, capfd, nproc, said):
    out = tmp_path / "run"
    done = run_main(["train", "--dataset", "digits", "--device", "cpu", "--nproc", nproc, *HUGE, "--out", str(out)],
                    capfd)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    line, = done.stderr.strip().splitlines()
    assert line.startswith(f"fedpar train: {said}") and "GiB of memory and this machine has" in line, line
    assert line.endswith("--model-arg), or shard it over machines with torchrun and --fsdp" if nproc == "1" else
                         "give a smaller --nproc or model, or spread the ranks over machines with torchrun"), line
    assert not out.exists()


def test_more_ranks_than_the_memory_holds_is_one_line_naming_the_nproc(tmp_path, capfd):
    free = available_bytes()
    if free is None or free > 1024 * RANK_BYTES:
        pytest.skip("this machine has memory for 1024 ranks (or does not say): --nproc cannot ask for more")
    nproc = min(1024, math.ceil(free / RANK_BYTES) + 1)
    out = tmp_path / "run"
    done = run_main(["train", "--dataset", "digits", "--device", "cpu", "--nproc", str(nproc), "--batch-size",
                     str(nproc), "--out", str(out)], capfd)
    assert done.returncode == 2, done.stderr
    line, = done.stderr.strip().splitlines()
    match = re.fullmatch(rf"fedpar train: training on {nproc} ranks here \(--nproc {nproc}\) needs about ([0-9.]+) "
                         r"GiB of memory and this machine has ([0-9.]+) GiB available; give a smaller --nproc or "
                         r"model, or spread the ranks over machines with torchrun", line)
    assert match and float(match[1]) > float(match[2]) >= nproc * RANK_BYTES / 2**30 - 1, line
    assert not out.exists()
