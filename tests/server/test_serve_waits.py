"""One-shot `fedpar serve` that loses an agent mid-run, below --min-available, says that it waits and for whom (after
3 s, again when who is connected changes, and every minute), as a service's run does: it printed nothing for 11
minutes (QA: a secure-aggregation run after kill -9 of one of three agents). Real serve and agents on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from support.digit_agents import start_digit_agents
from support.processes import port_in_file

ROOT = Path(__file__).resolve().parents[2]


def test_serve_says_it_waits_for_agents_once_one_is_gone_mid_run(tmp_path):
    err = tmp_path / "serve.err"
    with open(err, "w") as stderr:
        serve = subprocess.Popen([sys.executable, "-m", "fedpar", "serve", "--insecure", "--port", "0", "--port-file",
                                  str(tmp_path / "port"), "--min-available", "2", "--clients-per-round", "2",
                                  "--rounds", "100000", "--heartbeat", "1", "--no-central-eval", "--out",
                                  str(tmp_path / "out")], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                 stdout=subprocess.DEVNULL, stderr=stderr)
    agents = []
    metrics = tmp_path / "out" / "metrics.jsonl"
    try:
        end = time.monotonic() + 60
        port = port_in_file(tmp_path / "port", serve, err)
        torch.set_num_threads(1)
        agents, _, _ = start_digit_agents(port, ["a0", "a1"])
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 3:
            assert serve.poll() is None and time.monotonic() < end, err.read_text()
            time.sleep(0.05)
        agents[1].stop()  # it leaves: 1 of the 2 needed stays
        said = "fedpar serve: waiting for 2 agents (--min-available): 1 connected now (a0)"
        end = time.monotonic() + 20
        while said not in err.read_text() and time.monotonic() < end:
            time.sleep(0.1)
        assert said in err.read_text(), err.read_text()[-2000:]
    finally:
        serve.kill()
        serve.wait()
        for agent in agents:
            agent.stop()


def test_serve_resumed_with_every_round_done_does_not_say_it_waits_for_agents(tmp_path):
    # It said "every one of the 2 rounds is done already", then "waiting for 2 agents (start them with: ...)", and
    # exited 0 without waiting.
    from fedpar.aggregation import build_strategy
    from fedpar.server.checkpoint import Checkpoint, save_checkpoint
    from fedpar.server.members import CohortSampler
    from fedpar.server.assembly import synthetic_model

    names, weights = synthetic_model(1000, 0)
    state = {"sampler": CohortSampler(0).state(), "strategy": build_strategy("fedavg").state_dict()[1]}
    save_checkpoint(tmp_path / "ck", Checkpoint(3, names, weights, {}, state))
    done = subprocess.run([sys.executable, "-m", "fedpar", "serve", "--insecure", "--port", "0", "--model", "synthetic",
                           "--params", "1000", "--seed", "0", "--rounds", "2", "--min-available", "2",
                           "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "every one of the 2 rounds is done already" in done.stderr, done.stderr
    assert "waiting for" not in done.stdout + done.stderr and "start them with" not in done.stdout, done.stdout
    assert "only to tell agents that training is over" in done.stdout, done.stdout
