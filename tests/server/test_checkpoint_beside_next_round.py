"""A round's central evaluation and checkpoint are done beside the next round, never more than one round behind: the
next round's tasks go out while they run, and that round counts no update before they are done; each metrics line
follows its round's evaluation and checkpoint, and the run ends with every round's line and the last round's
checkpoint."""

from __future__ import annotations

import threading

import numpy as np

import fedpar.server.coordinator as coordinator_module
from fedpar.protocol.codec import ModelLayout
from fedpar.server.checkpoint import load_checkpoint

NAMES = ["w"]
DEADLINE = 1.0


def test_the_next_round_goes_out_while_a_checkpoint_is_written_and_counts_no_update_before(start_coordinator,
                                                                                          agents, tmp_path,
                                                                                          monkeypatch):
    ckpt = tmp_path / "ckpt"
    release, writing = threading.Event(), threading.Event()
    real_save = coordinator_module.save_checkpoint

    def slow_first_save(root, checkpoint):  # the disk is slow while round 1's checkpoint is written
        if checkpoint.round_id == 1:
            writing.set()
            assert release.wait(30)
        return real_save(root, checkpoint)

    monkeypatch.setattr(coordinator_module, "save_checkpoint", slow_first_save)
    weights = [np.zeros(8, np.float32)]
    server = start_coordinator(weights, names=NAMES, rounds=3, clients_per_round=1, min_available=1,
                               checkpoint_dir=ckpt, deadline_seconds=DEADLINE)
    at_each_row = []
    server.coordinator.on_round_end.append(lambda row: at_each_row.append((row["round"],
                                                                          load_checkpoint(ckpt).round_id)))
    (agent,) = agents(server.address, ["a"])
    layout = ModelLayout.of_arrays(NAMES, weights)
    for round_id in (1, 2, 3):
        task = agent.task()
        assert task.round == round_id
        start = agent.download(task, layout)
        upload = lambda: agent.upload(task, [w + round_id for w in start], 10, names=NAMES)  # noqa: E731
        if round_id != 2:
            assert upload().accepted
            continue
        # round 2's task went out and its update came in while round 1's checkpoint is still being written; the
        # update is counted only once it is written
        assert writing.wait(10)  # begun beside round 2's opening, perhaps just after its task went out
        assert not (ckpt / "LATEST").exists() and at_each_row == []
        replies = []
        uploading = threading.Thread(target=lambda: replies.append(upload()))
        uploading.start()
        uploading.join(DEADLINE + 0.3)  # the round's deadline does not run while it may not count the update
        assert uploading.is_alive() and server.coordinator.current.accepted == 0
        release.set()
        uploading.join(30)
        assert replies[0].accepted
    assert server.wait(30)
    assert at_each_row == [(1, 1), (2, 2), (3, 3)]  # each line after its own round's checkpoint, in order
    rows = list(server.coordinator.metrics.read_rows())
    assert [(r["round"], r["status"], r["reported"]) for r in rows] == [(1, "ok", 1), (2, "ok", 1), (3, "ok", 1)]
    final = load_checkpoint(ckpt)
    assert final.round_id == 3 and final.state["metrics_row"]["round"] == 3
    assert np.array_equal(final.arrays[0], np.full(8, 6, np.float32))  # 0 + 1 + 2 + 3


def test_the_next_round_goes_out_while_the_last_one_is_evaluated_and_its_line_carries_that_models_score(
        start_coordinator, agents):
    release, evaluating = threading.Event(), threading.Event()
    scored = []

    def slow_first_evaluation(weights):  # round 1's model is slow to score (a large test set)
        scored.append(float(weights[0][0]))
        if len(scored) == 1:
            evaluating.set()
            assert release.wait(30)
        return {"test_accuracy": float(weights[0][0]) / 10}

    weights = [np.zeros(8, np.float32)]
    server = start_coordinator(weights, names=NAMES, rounds=2, clients_per_round=1, min_available=1,
                               deadline_seconds=DEADLINE, evaluate_fn=slow_first_evaluation)
    (agent,) = agents(server.address, ["a"])
    layout = ModelLayout.of_arrays(NAMES, weights)
    task = agent.task()
    start = agent.download(task, layout)
    assert agent.upload(task, [w + 1 for w in start], 10, names=NAMES).accepted
    task = agent.task()  # round 2's task goes out while round 1's model is being scored
    assert task.round == 2 and evaluating.wait(10) and not release.is_set()
    assert list(server.coordinator.metrics.read_rows()) == []
    start = agent.download(task, layout)
    replies = []
    uploading = threading.Thread(target=lambda: replies.append(agent.upload(task, [w + 2 for w in start], 10,
                                                                            names=NAMES)))
    uploading.start()
    uploading.join(DEADLINE + 0.3)  # counted only once round 1 is scored and written; its deadline waits meanwhile
    assert uploading.is_alive() and server.coordinator.current.accepted == 0
    release.set()
    uploading.join(30)
    assert replies[0].accepted
    assert server.wait(30)
    assert scored == [1.0, 3.0]
    rows = list(server.coordinator.metrics.read_rows())
    assert [(r["round"], r["status"], r["test_accuracy"]) for r in rows] == [(1, "ok", 0.1), (2, "ok", 0.3)]
