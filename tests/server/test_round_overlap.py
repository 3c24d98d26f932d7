"""A round's central evaluation overlaps the next round when there is no checkpoint to write first; with one, the next
round waits for the checkpoint (the model is checkpointed before the next round), over real gRPC."""

from __future__ import annotations

import threading
import time

import numpy as np

from fedpar.protocol.codec import ModelLayout

EVAL_SECONDS = 0.4


def _two_rounds(start_coordinator, agents, **config) -> tuple[list[dict], float, float]:
    """Two rounds of one scripted agent under a central evaluation that takes EVAL_SECONDS: the rows, when round 1's
    evaluation ended and when round 2's task reached the agent."""
    init = [np.zeros((4, 3), np.float32), np.zeros(3, np.float32)]
    evaluated: list[float] = []
    lock = threading.Lock()

    def evaluate(weights):
        time.sleep(EVAL_SECONDS)
        with lock:
            evaluated.append(time.monotonic())
        return {"test_accuracy": float(weights[1][0])}

    server = start_coordinator(init, evaluate_fn=evaluate, rounds=2, clients_per_round=1, min_available=1, **config)
    (bot,) = agents(server.address, ["a"])
    layout = ModelLayout.of_arrays([f"t{i}" for i in range(len(init))], init)
    task_arrived = []
    for r in (1, 2):
        task = bot.task()
        task_arrived.append(time.monotonic())
        bot.download(task, layout)
        assert bot.upload(task, [np.full_like(w, r) for w in init], 10).accepted
    assert server.wait(30)
    return server.coordinator.metrics.read_rows(), evaluated[0], task_arrived[1]


def test_the_next_round_opens_while_the_last_one_is_scored_and_its_row_is_written_in_order(start_coordinator, agents):
    rows, round1_scored, round2_task = _two_rounds(start_coordinator, agents)
    assert round2_task < round1_scored  # round 2's task went out before round 1's evaluation ended
    assert [(r["round"], r["status"], r["test_accuracy"]) for r in rows] == [(1, "ok", 1.0), (2, "ok", 2.0)]


def test_with_a_checkpoint_the_next_round_waits_for_it(start_coordinator, agents, tmp_path):
    rows, round1_scored, round2_task = _two_rounds(start_coordinator, agents, checkpoint_dir=tmp_path / "ckpt")
    assert round2_task > round1_scored
    assert [(r["round"], r["test_accuracy"]) for r in rows] == [(1, 1.0), (2, 2.0)]


