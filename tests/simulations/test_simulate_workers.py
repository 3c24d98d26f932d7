"""`fedpar simulate-workers` under torchrun: two "machines" (torchrun --nnodes 2 on 127.0.0.1, the first with two
local ranks, the second with one) host one virtual population, with FedScale-shaped traces, against a real `fedpar serve --accept-populations` that
runs a virtual clock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.ports import free_port
from support.processes import port_in_file

ROOT = Path(__file__).resolve().parents[2]
CLIENTS, PER_ROUND, ROUNDS = 300, 20, 3


def test_torchrun_two_nodes_and_two_local_ranks_host_one_population_against_one_coordinator(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    serve = subprocess.Popen(
        [sys.executable, "-m", "fedpar", "serve", "--insecure", "--port", "0", "--port-file", str(tmp_path / "port"),
         "--out", str(tmp_path / "out"), "--accept-populations", "--clock", "virtual",
         "--min-available", str(CLIENTS // 3),  # with availability traces, never everybody is online at once
         "--clients-per-round", str(PER_ROUND), "--rounds", str(ROUNDS), "--local-epochs", "1"],
        cwd=ROOT, env=env, stdout=open(tmp_path / "serve.log", "w"), stderr=subprocess.STDOUT)
    nodes = []
    try:
        server = f"127.0.0.1:{port_in_file(tmp_path / 'port', serve, tmp_path / 'serve.log')}"
        master = free_port()
        for node in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(2 - node),
                   "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(master),
                   "-m", "fedpar", "simulate-workers", "--server", server, "--insecure", "--clients", str(CLIENTS),
                   "--val-fraction", "0", "--seats", "2", "--trace", "fedscale"]
            nodes.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(tmp_path / f"node{node}.log", "w"),
                                          stderr=subprocess.STDOUT))
        for node in nodes:
            assert node.wait(120) == 0, "\n".join((tmp_path / f"node{n}.log").read_text()[-3000:] for n in (0, 1))
        assert serve.wait(60) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        for proc in (serve, *nodes):
            if proc.poll() is None:
                proc.kill()
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["status"], r["reported"]) for r in rows] == [("ok", PER_ROUND)] * ROUNDS
    assert 0 < rows[0]["sim_seconds"] < rows[-1]["sim_seconds"] < 60 * ROUNDS  # simulated seconds, on the clock
    logs = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    ranks = [line for log in logs for line in log.splitlines() if " clients hosted" in line]
    assert sorted(line.split(":")[0] for line in ranks) == ["rank 0/3", "rank 1/3", "rank 2/3"], logs
    hosted = [int(line.split(" clients hosted")[0].rsplit(": ", 1)[1]) for line in ranks]
    assert hosted == [CLIENTS // 3] * 3  # torchrun's ranks split the population
    ran = [int(line.split(" tasks run")[0].rsplit(", ", 1)[1]) for line in ranks]
    assert sum(ran) >= PER_ROUND * ROUNDS and min(ran) > 0  # every rank's clients were sampled
