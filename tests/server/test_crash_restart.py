"""`kill -9` of a real `fedpar serve` in the middle of a round, restart on the same checkpoint and port.

Real agents (client.agent.Agent, training an MLP on digits) run in threads of this process and must
reconnect by themselves; the run must finish with every round exactly once in metrics.jsonl.
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
import torch

from fedpar.cli.main import build_parser
from fedpar.client.agent import Agent, AgentConfig
from fedpar.client.trainer import LocalTrainer
from fedpar.datasets import load_dataset
from fedpar.models import get_weights
from fedpar.models.for_data import build_model_for_data
from fedpar.protocol.tensorfile import load_tensors
from fedpar.server.coordinator import cohort_digest
from fedpar.server.sampler import CohortSampler
from fedpar.simulations.clientdata import local_split, partition_indices

ROOT = Path(__file__).resolve().parents[2]
IDS = ["ag0", "ag1", "ag2", "ag3"]
ROUNDS, K, SEED, KILL_ROUND = 4, 2, 3, 2


class RecordingTrainer(LocalTrainer):
    """The real local trainer; it records the global weights each task starts from, and in round
    KILL_ROUND (before the kill) holds the second agent back so the kill lands mid-round."""

    def __init__(self, agent_id, hub, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.agent_id, self.hub = agent_id, hub

    def train(self, epochs, batch_size, lr, stop_at=float("inf"), proximal_mu=0.0, round_id=0):
        self.hub.record(round_id, self.agent_id, get_weights(self.model))
        self.hub.maybe_hold(round_id)
        return super().train(epochs, batch_size, lr, stop_at, proximal_mu, round_id)


class Hub:
    """Shared by the agent threads: what each started from, and the gate that holds one agent back."""

    def __init__(self):
        self.lock = threading.Lock()
        self.starts: list[tuple[int, str, list[np.ndarray]]] = []
        self.killed = threading.Event()
        self.started_in_kill_round = 0

    def record(self, round_id, agent_id, weights):
        with self.lock:
            self.starts.append((round_id, agent_id, [w.copy() for w in weights]))

    def maybe_hold(self, round_id):
        with self.lock:
            if round_id != KILL_ROUND or self.killed.is_set():
                return
            self.started_in_kill_round += 1
            hold = self.started_in_kill_round == 2
        if hold:
            self.killed.wait(60)


def _plaintext_flag() -> list[str]:
    """``--insecure`` where `fedpar serve` has TLS by default (these agents dial plaintext loopback)."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return ["--insecure"] if any("--insecure" in a.option_strings for a in serve._actions) else []


def _serve(tmp: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fedpar.cli.main", "serve", *_plaintext_flag(), "--port", str(port),
           "--port-file", str(tmp / "port"), "--checkpoint-dir", str(tmp / "ckpt"), "--out", str(tmp / "out"),
           "--rounds", str(ROUNDS), "--min-available", str(len(IDS)), "--clients-per-round", str(K),
           "--overselect", "1.0", "--deadline", "30", "--seed", str(SEED), "--heartbeat", "1",
           "--liveness-timeout", "10", "--local-epochs", "1"]
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


def test_kill_9_mid_round_then_restart_resumes_and_finishes(tmp_path):
    torch.set_num_threads(1)
    (tmp_path / "port").unlink(missing_ok=True)
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

        # Kill once round KILL_ROUND has one accepted update and another agent is still training.
        accepted = lambda: sum(a.stats.accepted for a in agents)  # noqa: E731
        _wait_for(lambda: accepted() >= K * (KILL_ROUND - 1) + 1 and hub.started_in_kill_round >= 2, 60,
                  f"round {KILL_ROUND} never got one update in; errors={errors}")
        ckpt = tmp_path / "ckpt"
        assert (ckpt / "LATEST").read_text().strip() == f"round-{KILL_ROUND - 1:06d}"
        names, saved, _ = load_tensors(ckpt / f"round-{KILL_ROUND - 1:06d}" / "global.safetensors")
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
        hub.killed.set()  # the held agent trains on and finds the coordinator gone
        rows_before = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows_before] == list(range(1, KILL_ROUND))

        time.sleep(0.5)
        server = _serve(tmp_path, port)  # same port and checkpoint directory
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

    # Every round exactly once, in order, and the in-flight round counted only its re-run updates.
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
    assert all(r["status"] == "ok" and r["reported"] == K for r in rows), rows
    # Agents noticed the restart (UNAUTHENTICATED) and re-joined by themselves.
    assert sum(a.stats.reconnects for a in agents) >= len(IDS)
    # The same cohorts as an uninterrupted run: the sampler's RNG stream continued through the crash.
    sampler = CohortSampler(SEED)
    assert [r["cohort_digest"] for r in rows] == [cohort_digest(sampler.sample(IDS, K)) for _ in rows]
    # The model checkpointed after round KILL_ROUND-1 is, bit for bit, what the restarted coordinator served.
    starts = [(aid, w) for r, aid, w in hub.starts if r == KILL_ROUND]
    assert len(starts) == K + 2  # two before the kill, K after the restart
    for _, weights in starts:
        assert [w.tobytes() for w in weights] == [a.tobytes() for a in saved]
    final = (tmp_path / "ckpt" / "LATEST").read_text().strip()
    assert final == f"round-{ROUNDS:06d}"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["LATEST", f"round-{ROUNDS - 1:06d}", final]
