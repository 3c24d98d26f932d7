"""`kill -9` of a real `fedpar serve` in the middle of a round (plain, then secure aggregation), restart on the
same checkpoint and port: the in-flight round runs again from scratch and every round counts once.

Real agents (client.agent.Agent, training an MLP on digits) run in threads of this process and must
reconnect by themselves.
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

from fedpar.client.agent import Agent
from fedpar.client.trainer import LocalTrainer
from fedpar.models import get_weights
from fedpar.protocol.tensorfile import load_tensors
from fedpar.server.coordinator import cohort_digest
from fedpar.server.members import CohortSampler
from support.digit_agents import start_digit_agents

ROOT = Path(__file__).resolve().parents[2]
KILL_ROUND = 2  # one agent is held in this round so the kill lands mid-round
IDS, ROUNDS, K, SEED = ["ag0", "ag1", "ag2", "ag3"], 4, 2, 3  # plain rounds
SECURE_IDS = ["ag0", "ag1", "ag2"]  # secure rounds take every agent: a held one keeps the masking stage open
SECURE_ROUNDS = 3


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
    """The real local trainer; records where each run started and ended, and lets the hub hold it back."""

    def __init__(self, agent_id, hub, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.agent_id, self.hub = agent_id, hub

    def train(self, epochs, batch_size, lr, stop_at=float("inf"), proximal_mu=0.0, round_id=0):
        """Record the starting weights, maybe wait for the kill, train, record the result."""
        after_kill = self.hub.killed.is_set()
        start = [w.copy() for w in get_weights(self.model)]
        self.hub.hold_if_second(round_id)
        result = super().train(epochs, batch_size, lr, stop_at, proximal_mu, round_id)
        with self.hub.lock:
            self.hub.runs.append(dict(round=round_id, agent=self.agent_id, after_kill=after_kill, start=start,
                                      end=[w.copy() for w in get_weights(self.model)], examples=result.examples))
        return result


QUICK_TRAINING = ["--local-epochs", "1", "--batch-size", "32", "--lr", "0.05"]  # the defaults are 5, 16, 0.1


def _serve(tmp: Path, port: int, flags: list[str]) -> subprocess.Popen:
    """Start `fedpar serve --insecure` on ``port`` with checkpoints in tmp/ckpt and outputs in tmp/out."""
    cmd = [sys.executable, "-m", "fedpar.cli.main", "serve", "--insecure", "--port", str(port),
           "--port-file", str(tmp / "port"), "--checkpoint-dir", str(tmp / "ckpt"), "--out", str(tmp / "out"),
           *QUICK_TRAINING, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(tmp / "serve.log", "a") as log:  # a file, not a pipe: a full pipe would block the server
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_for(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` until it holds; TimeoutError naming ``what`` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise TimeoutError(what)


def _plain_flags() -> list[str]:
    return ["--rounds", str(ROUNDS), "--min-available", str(len(IDS)), "--clients-per-round", str(K),
            "--overselect", "1.0", "--deadline", "30", "--seed", str(SEED), "--heartbeat", "1",
            "--liveness-timeout", "10", "--local-epochs", "1"]


def _secure_flags() -> list[str]:
    k = len(SECURE_IDS)
    return ["--rounds", str(SECURE_ROUNDS), "--min-available", str(k), "--clients-per-round", str(k),
            "--overselect", "1.0", "--deadline", "30", "--seed", "3", "--heartbeat", "1",
            "--liveness-timeout", "10", "--local-epochs", "1", "--no-central-eval",
            "--secure-aggregation", "--secagg-stage-seconds", "10"]


def _rows(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]


def _model(ckpt: Path, round_id: int) -> list[np.ndarray]:
    return load_tensors(ckpt / f"round-{round_id:06d}" / "global.safetensors")[1]


def _run_killing_once(tmp_path: Path, flags: list[str], ids: list[str], k: int) -> tuple[list[Agent], Hub, list]:
    """Serve with ``flags``, run the agents, SIGKILL the coordinator once round KILL_ROUND has one accepted
    update and a second agent is held in training, restart it on the same port and checkpoint directory, and
    wait until the agents finish. Returns the agents, the hub and the model checkpointed before the kill."""
    torch.set_num_threads(1)
    server = _serve(tmp_path, 0, flags)
    hub = Hub()
    agents, threads, errors = [], [], []
    try:
        _wait_for(lambda: (tmp_path / "port").exists() or server.poll() is not None, 60, "serve did not start")
        assert server.poll() is None, (tmp_path / "serve.log").read_text()
        port = int((tmp_path / "port").read_text())
        agents, threads, errors = start_digit_agents(
            port, ids, trainer=lambda agent_id, *args, **kw: RecordingTrainer(agent_id, hub, *args, **kw))
        accepted = lambda: sum(a.stats.accepted for a in agents)  # noqa: E731
        _wait_for(lambda: accepted() >= k * (KILL_ROUND - 1) + 1 and hub.started_in_kill_round >= 2, 60,
                  f"round {KILL_ROUND} never got one update in; errors={errors}")
        ckpt = tmp_path / "ckpt"
        assert (ckpt / "LATEST").read_text().strip() == f"round-{KILL_ROUND - 1:06d}"
        before_kill = _model(ckpt, KILL_ROUND - 1)
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
        hub.killed.set()  # the held agent trains on and finds the coordinator gone
        assert [r["round"] for r in _rows(tmp_path)] == list(range(1, KILL_ROUND))

        time.sleep(0.5)
        server = _serve(tmp_path, port, flags)  # same port, checkpoint directory and flags
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
    assert f"resumed from checkpoint after round {KILL_ROUND - 1}" in (tmp_path / "serve.log").read_text()
    return agents, hub, before_kill


def test_kill_9_mid_round_then_restart_resumes_and_finishes(tmp_path):
    agents, hub, saved = _run_killing_once(tmp_path, _plain_flags(), IDS, K)

    # Every round exactly once, in order, and the in-flight round counted only its re-run updates.
    rows = _rows(tmp_path)
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
    assert all(r["status"] == "ok" and r["reported"] == K for r in rows), rows
    # Agents noticed the restart (UNAUTHENTICATED) and re-joined by themselves.
    assert sum(a.stats.reconnects for a in agents) >= len(IDS)
    # The same cohorts as an uninterrupted run: the sampler's RNG stream continued through the crash.
    sampler = CohortSampler(SEED)
    assert [r["cohort_digest"] for r in rows] == [cohort_digest(sampler.sample(IDS, K)) for _ in rows]
    # The model checkpointed after round KILL_ROUND-1 is, bit for bit, what the restarted coordinator served.
    starts = [run["start"] for run in hub.runs if run["round"] == KILL_ROUND]
    assert len(starts) == K + 2  # two before the kill, K after the restart
    for weights in starts:
        assert [w.tobytes() for w in weights] == [a.tobytes() for a in saved]
    final = (tmp_path / "ckpt" / "LATEST").read_text().strip()
    assert final == f"round-{ROUNDS:06d}"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["LATEST", f"round-{ROUNDS - 1:06d}", final]
    _check_kept_model(tmp_path, rows[-1])
    # The rows and the summary count the whole run's time: the restarted process went on from the checkpointed
    # round's wall_seconds (they started from 0 again, and summary.json held the last process's seconds only).
    assert all(b["wall_seconds"] > a["wall_seconds"] for a, b in zip(rows, rows[1:])), rows
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["earlier_processes_seconds"] == rows[KILL_ROUND - 2]["wall_seconds"]
    assert summary["wall_seconds"] > rows[-1]["wall_seconds"]


def _check_kept_model(tmp_path: Path, last_row: dict) -> None:
    """OUT/global.* hold the last round's model (as checkpointed), and `fedpar export` of the --out folder and
    of the checkpoint directory both give a state_dict the model loads, with the same tensors."""
    import torch

    from fedpar.cli.main import main
    from fedpar.models.for_data import build_model_for_data

    info = json.loads((tmp_path / "out" / "global.json").read_text())
    assert info["round"] == ROUNDS and not info["interrupted"] and info["metrics"] == last_row
    assert info["model"] == {"model": "mlp", "dataset": "digits", "input_shape": [1, 8, 8], "num_classes": 10}
    final = _model(tmp_path / "ckpt", ROUNDS)
    names, kept, meta = load_tensors(tmp_path / "out" / "global.safetensors")
    assert meta["round"] == str(ROUNDS) and [a.tobytes() for a in kept] == [a.tobytes() for a in final]
    for source in (tmp_path / "out", tmp_path / "ckpt"):
        target = tmp_path / f"{source.name}.pt"
        assert main(["export", str(source), "--to", str(target)]) == 0
        model = build_model_for_data(info["model"]["model"], tuple(info["model"]["input_shape"]),
                                     info["model"]["num_classes"])
        model.load_state_dict(torch.load(target, weights_only=True))  # strict: every entry, by name
        assert list(model.state_dict()) == names
        assert all(np.array_equal(t.numpy(), a) for t, a in zip(model.state_dict().values(), final))


@pytest.mark.timeout(120)
def test_kill_9_mid_secure_round_then_restart_reruns_the_round_masked(tmp_path):
    ids, rounds, k = SECURE_IDS, SECURE_ROUNDS, len(SECURE_IDS)
    agents, hub, before_kill = _run_killing_once(tmp_path, _secure_flags(), ids, k)

    # Every round exactly once, each a complete secure round over the whole cohort.
    rows = _rows(tmp_path)
    assert [r["round"] for r in rows] == list(range(1, rounds + 1))
    for r in rows:
        assert (r["status"], r["reported"], r["secagg_survivors"], r["secagg_dropped"]) == ("ok", k, k, 0), r
        assert "secagg_failure" not in r and "train_loss" not in r  # masked: no per-agent metrics
    # Agents noticed the restart (their sessions were unknown to it) and re-joined by themselves.
    assert all(a.stats.reconnects >= 1 for a in agents), [a.stats for a in agents]

    # Round KILL_ROUND was started twice: two or three agents trained before the kill, all k again after it.
    kill_round = [run["after_kill"] for run in hub.runs if run["round"] == KILL_ROUND]
    assert kill_round.count(False) >= 2 and kill_round.count(True) == k, kill_round
    final = tmp_path / "ckpt"
    assert (final / "LATEST").read_text().strip() == f"round-{rounds:06d}"
    models = {KILL_ROUND - 1: before_kill, **{r: _model(final, r) for r in range(KILL_ROUND, rounds + 1)}}
    for round_id in range(KILL_ROUND, rounds + 1):
        runs = [run for run in hub.runs if run["round"] == round_id and run["after_kill"]]
        assert sorted(run["agent"] for run in runs) == ids
        # What the restarted coordinator served is, bit for bit, the checkpoint of the round before.
        for run in runs:
            assert [w.tobytes() for w in run["start"]] == [w.tobytes() for w in models[round_id - 1]]
        # Its checkpoint is the example-weighted mean of these k runs' updates only (nothing of the masked
        # upload that arrived before the kill), to within the secure aggregation's quantization error.
        row = rows[round_id - 1]
        weights = [run["examples"] for run in runs]
        assert row["examples"] == sum(weights)
        for i, new in enumerate(models[round_id]):
            start = runs[0]["start"][i].astype(np.float64)
            mean = start + sum(w * (run["end"][i] - start) for w, run in zip(weights, runs)) / sum(weights)
            np.testing.assert_allclose(new, mean, rtol=0, atol=row["secagg_error_bound"] + 1e-6)
        assert not all(np.array_equal(a, b) for a, b in zip(models[round_id], models[round_id - 1]))
