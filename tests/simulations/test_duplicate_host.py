"""`fedpar simulate-workers` launched twice with the same rank (a command re-run in a second terminal, two nodes
given the same --node-rank): the second is refused in one line and exits non-zero, while the first, a real process
hosting its slice against a real coordinator over loopback gRPC, keeps its session and runs every round. The
rounds wait for one more member, an agent the test speaks for, so that the duplicate comes while the first host is
joined and its rounds are still to come."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedpar.aggregation import build_strategy
from fedpar.datasets import load_dataset
from fedpar.server.assembly import CoordinatorAssembly
from fedpar.server.config import CoordinatorConfig
from support.in_process import run_main
from support.scripted_agent import ScriptedAgent

ROOT = Path(__file__).resolve().parents[2]
CLIENTS, ROUNDS = 4, 3  # the host's members; the test's agent makes one more in every round
HOST = "host-0-of-1"  # a launch without torchrun is rank 0 of 1


@pytest.mark.timeout(120)  # a duplicate that takes the first one's place runs (and the two trade it) for ever
def test_a_second_host_with_the_same_rank_is_refused_in_one_line_and_the_first_runs_on(tmp_path, capfd):
    rows: list[dict] = []
    server = CoordinatorAssembly.for_data("mlp", load_dataset("digits"), 0, "cpu").server(
        CoordinatorConfig(min_available=CLIENTS + 1, clients_per_round=CLIENTS + 1, overselect=1.0, rounds=ROUNDS,
                          accept_populations=True, deadline_seconds=60.0, heartbeat_seconds=1.0),
        build_strategy("fedavg"), on_round_end=[rows.append])
    server.start()
    host_args = ["simulate-workers", "--server", server.address, "--insecure", "--clients", str(CLIENTS),
                 "--dataset", "digits", "--model", "mlp", "--seats", "2", "--max-backoff", "0.5",
                 "--device", "cpu"]  # the second runs in this process: no CUDA context here on a GPU box
    log = tmp_path / "first.log"
    with open(log, "w") as out:  # a file, not a pipe: a full pipe would block the process
        first = subprocess.Popen([sys.executable, "-m", "fedpar", *host_args], cwd=ROOT, stdout=out,
                                 stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    agent = None
    try:
        registry = server.coordinator.registry
        end = time.monotonic() + 60
        while registry.host(HOST) is None:
            assert first.poll() is None and time.monotonic() < end, log.read_text()
            time.sleep(0.05)
        session = registry.host(HOST)

        second = run_main(host_args, capfd)

        assert second.returncode == 1, second.stderr
        lines = second.stderr.strip().splitlines()
        coordinator_said = [line for line in lines if " fedpar.server " in line]  # it shares this test's stderr
        assert any("refused a second process for simulation host 'host-0-of-1'" in line for line in coordinator_said)
        said = [line for line in lines if line not in coordinator_said and "--insecure: plaintext gRPC" not in line]
        assert len(said) == 1 and "Traceback" not in second.stderr, second.stderr  # beside the --insecure warning
        assert said[0].startswith(f"fedpar simulate-workers: rank 0 of 1: host '{HOST}' is already connected from "
                                  "127.0.0.1:"), said
        assert said[0].endswith("each simulate-workers process needs its own rank (its own torchrun --node-rank), "
                                "or stop the other one first"), said
        assert registry.host(HOST) is session and first.poll() is None  # the first keeps its place, untouched

        agent = ScriptedAgent(server.address, "agent-0")
        for _ in range(ROUNDS):  # each round waits for this agent's update: the host's members must make theirs
            task = agent.task(timeout=60)
            assert agent.upload(task, agent.download(task, server.coordinator.layout), 10,
                                names=server.coordinator.names).accepted
        assert first.wait(60) == 0, log.read_text()
    finally:
        if agent is not None:
            agent.close()
        if first.poll() is None:
            first.kill()
        server.stop()
    assert [(r["status"], r["reported"]) for r in rows] == [("ok", CLIENTS + 1)] * ROUNDS, rows
    said = log.read_text()
    assert f"{CLIENTS} clients hosted, {CLIENTS * ROUNDS} tasks run" in said and "Traceback" not in said, said
