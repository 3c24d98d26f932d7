"""`kill -9` of a real `fedpar serve --secure-aggregation` in the middle of a secure round, then a restart on the
same checkpoint and port: the in-flight round runs again from scratch, masked, and every round counts once.

Real agents (client.agent.Agent training an MLP on digits) run in threads of this process and must
reconnect by themselves, as in test_crash_restart.py (the plain-round version of this test).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedpar.client.agent import Agent, AgentConfig
from fedpar.client.trainer import LocalTrainer
from fedpar.datasets import load_dataset
from fedpar.models import get_weights
from fedpar.models.for_data import build_model_for_data
from fedpar.protocol.tensorfile import load_tensors
from fedpar.simulations.clientdata import local_split, partition_indices

ROOT = Path(__file__).resolve().parents[2]
IDS = ["ag0", "ag1", "ag2"]
ROUNDS, KILL_ROUND = 3, 2
K = len(IDS)  # every agent in every cohort: the round cannot close while one of them is held back


class Hub:
    """Shared by the agent threads: every local training run, and the gate that holds one agent back."""

    def __init__(self):
        self.lock = threading.Lock()
        self.runs: list[dict] = []  # round, agent, after_kill, start and end weights, examples
        self.killed = threading.Event()
        self.started_in_kill_round = 0

    def hold_if_second(self, round_id: int) -> None:
        """In KILL_ROUND before the kill, the second agent to start training waits for the kill."""
        with self.lock:
            if round_id != KILL_ROUND or self.killed.is_set():
                return
            self.started_in_kill_round += 1
            hold = self.started_in_kill_round == 2
        if hold:
            self.killed.wait(60)


class RecordingTrainer(LocalTrainer):
    """The real local trainer; records where each run started and ended (agents of a secure round have
    already shared their keys when they train, so a held agent keeps the round's masking stage open)."""

    def __init__(self, agent_id, hub, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.agent_id, self.hub = agent_id, hub

    def train(self, epochs, batch_size, lr, stop_at=float("inf"), proximal_mu=0.0, round_id=0):
        after_kill = self.hub.killed.is_set()
        start = [w.copy() for w in get_weights(self.model)]
        self.hub.hold_if_second(round_id)
        result = super().train(epochs, batch_size, lr, stop_at, proximal_mu, round_id)
        with self.hub.lock:
            self.hub.runs.append(dict(round=round_id, agent=self.agent_id, after_kill=after_kill, start=start,
                                      end=[w.copy() for w in get_weights(self.model)], examples=result.examples))
        return result


def _serve(tmp: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fedpar.cli.main", "serve", "--insecure", "--port", str(port),
           "--port-file", str(tmp / "port"), "--checkpoint-dir", str(tmp / "ckpt"), "--out", str(tmp / "out"),
           "--rounds", str(ROUNDS), "--min-available", str(K), "--clients-per-round", str(K),
           "--overselect", "1.0", "--deadline", "30", "--seed", "3", "--heartbeat", "1",
           "--liveness-timeout", "10", "--local-epochs", "1", "--no-central-eval",
           "--secure-aggregation", "--secagg-stage-seconds", "10"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(tmp / "serve.log", "a") as log:  # a file, not a pipe: a full pipe would block the server
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_for(predicate, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise TimeoutError(what)


def _rows(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]


def _model(ckpt: Path, round_id: int) -> list[np.ndarray]:
    return load_tensors(ckpt / f"round-{round_id:06d}" / "global.safetensors")[1]


@pytest.mark.timeout(120)
def test_kill_9_mid_secure_round_then_restart_reruns_the_round_masked(tmp_path):
    torch.set_num_threads(1)
    server = _serve(tmp_path, 0)
    hub = Hub()
    agents, threads, errors = [], [], []
    try:
        _wait_for(lambda: (tmp_path / "port").exists() or server.poll() is not None, 60, "serve did not start")
        assert server.poll() is None, (tmp_path / "serve.log").read_text()
        port = int((tmp_path / "port").read_text())
        splits = load_dataset("digits")
        parts = partition_indices(splits, "iid", len(IDS), 0)
        for i, agent_id in enumerate(IDS):
            train, val = local_split(splits.train, parts[i], 0.1, 0)
            torch.manual_seed(0)
            model = build_model_for_data("mlp", splits.input_shape, splits.num_classes)
            trainer = RecordingTrainer(agent_id, hub, model, train, val, seed=i)
            agents.append(Agent(AgentConfig(server=f"127.0.0.1:{port}", agent_id=agent_id, poll_seconds=1.0,
                                            initial_backoff=0.05, max_backoff=0.3, give_up_after=60), trainer))

        def run(agent):
            try:
                agent.run()
            except BaseException as exc:  # surfaced below
                errors.append(exc)
        threads = [threading.Thread(target=run, args=(a,), daemon=True) for a in agents]
        for t in threads:
            t.start()

        # Kill once round KILL_ROUND has one masked upload in and another agent (keys shared) is held.
        accepted = lambda: sum(a.stats.accepted for a in agents)  # noqa: E731
        _wait_for(lambda: accepted() >= K * (KILL_ROUND - 1) + 1 and hub.started_in_kill_round >= 2, 60,
                  f"round {KILL_ROUND} never got one masked update in; errors={errors}")
        ckpt = tmp_path / "ckpt"
        assert (ckpt / "LATEST").read_text().strip() == f"round-{KILL_ROUND - 1:06d}"
        before_kill = _model(ckpt, KILL_ROUND - 1)
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
        hub.killed.set()  # the held agent trains on and finds the coordinator gone
        assert [r["round"] for r in _rows(tmp_path)] == list(range(1, KILL_ROUND))

        time.sleep(0.5)
        server = _serve(tmp_path, port)  # same port, checkpoint directory and flags
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads), "agents did not finish"
        assert server.wait(30) == 0, (tmp_path / "serve.log").read_text()
    finally:
        hub.killed.set()
        if server.poll() is None:
            server.kill()
        for a in agents:
            a.stop()
    assert not errors, errors
    log = (tmp_path / "serve.log").read_text()
    assert f"resumed from checkpoint after round {KILL_ROUND - 1}" in log

    # Every round exactly once, each a complete secure round over the whole cohort.
    rows = _rows(tmp_path)
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
    for r in rows:
        assert (r["status"], r["reported"], r["secagg_survivors"], r["secagg_dropped"]) == ("ok", K, K, 0), r
        assert "secagg_failure" not in r and "train_loss" not in r  # masked: no per-agent metrics
    # Agents noticed the restart (their sessions were unknown to it) and re-joined by themselves.
    assert all(a.stats.reconnects >= 1 for a in agents), [a.stats for a in agents]

    # Round KILL_ROUND was started twice: two or three agents trained before the kill, all K again after it.
    kill_round = [run["after_kill"] for run in hub.runs if run["round"] == KILL_ROUND]
    assert kill_round.count(False) >= 2 and kill_round.count(True) == K, kill_round
    final = tmp_path / "ckpt"
    assert (final / "LATEST").read_text().strip() == f"round-{ROUNDS:06d}"
    models = {KILL_ROUND - 1: before_kill, **{r: _model(final, r) for r in range(KILL_ROUND, ROUNDS + 1)}}
    for round_id in range(KILL_ROUND, ROUNDS + 1):
        runs = [run for run in hub.runs if run["round"] == round_id and run["after_kill"]]
        assert sorted(run["agent"] for run in runs) == IDS
        # What the restarted coordinator served is, bit for bit, the checkpoint of the round before.
        for run in runs:
            assert [w.tobytes() for w in run["start"]] == [w.tobytes() for w in models[round_id - 1]]
        # Its checkpoint is the example-weighted mean of these K runs' updates only (nothing of the masked
        # upload that arrived before the kill), to within the secure aggregation's quantization error.
        row = rows[round_id - 1]
        weights = [run["examples"] for run in runs]
        assert row["examples"] == sum(weights)
        for i, new in enumerate(models[round_id]):
            start = runs[0]["start"][i].astype(np.float64)
            mean = start + sum(w * (run["end"][i] - start) for w, run in zip(weights, runs)) / sum(weights)
            np.testing.assert_allclose(new, mean, rtol=0, atol=row["secagg_error_bound"] + 1e-6)
        assert not all(np.array_equal(a, b) for a, b in zip(models[round_id], models[round_id - 1]))
