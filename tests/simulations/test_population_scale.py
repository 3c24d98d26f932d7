"""`fedpar simulate` with no flag but the population's size: 10,000 clients cost bytes each in the worker processes
and the coordinator, never an agent, a thread or a model apiece, so the whole process tree stays small."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

# The bound is the population's: on a GPU machine each of the 3 processes would also hold a CUDA context (3.1 GiB of
# resident memory in all, measured on the H200 box), so the run stays on the CPU there.
POPULATION_ON_CPU = ("--device", "cpu")
# The bound for 10,000 MNIST clients is 1.5 GiB resident (one agent per client took 8.3 GiB, this route 1.1 GiB):
# of that 1.1, 0.6 GiB was the libraries' mapped files, which _tree_rss leaves out (a CUDA build of torch maps more).
# The same headroom over the 520 MiB allocated in 3 processes: 256 MiB a process (the default worker count follows the
# cores: a 16-core box runs more workers, each with its own interpreter and torch).
LIMIT_BYTES_PER_PROCESS = 1 << 28


def _tree_rss(root: int) -> tuple[int, int]:
    """Resident bytes that ``root`` and every process below it allocated (anonymous and shared memory), summed
    (pages shared after a fork counted in each: an upper bound), and how many processes that is. Pages of mapped
    files are left out: they are the libraries' code, which the kernel can drop, and a CUDA build of torch maps
    about 0.2 GiB more of them a process."""
    total, processes, todo = 0, 0, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/status") as f:
                total += sum(int(line.split()[1]) for line in f if line.startswith(("RssAnon:", "RssShmem:"))) * 1024
            processes += 1
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration, ValueError):
            continue  # it ended meanwhile
    return total, processes


@pytest.mark.timeout(300)
def test_ten_thousand_clients_run_by_default_in_a_small_process_tree(tmp_path):
    # digits cannot give 10,000 clients an example each: FedProx's Synthetic(0.5, 0.5) is made for the population
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "fedpar", "simulate", "--clients", "10000", "--clients-per-round",
                             "20", "--dataset", "synthetic:0.5:0.5", "--rounds", "2", "--local-epochs", "1",
                             *POPULATION_ON_CPU, "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, processes, end = 0, 1, time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < end:
        rss, count = _tree_rss(proc.pid)
        peak, processes = max(peak, rss), max(processes, count)
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["status"], r["sampled"], r["reported"]) for r in rows] == [("ok", 20, 20)] * 2
    assert 0 < peak < LIMIT_BYTES_PER_PROCESS * processes, f"peak {peak / 2**20:.0f} MiB in {processes} processes"
    # measured here: 520 MiB in 3 processes (2 cores); 930 MiB on the 16-core GPU box
