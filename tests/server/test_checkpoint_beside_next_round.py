"""A round's checkpoint is written beside the next round, never more than one round behind: the next round's tasks go
out while it is being written, that round's close waits for it, each metrics line follows its round's checkpoint,
and the run ends with every round's line and the last round's checkpoint."""

from __future__ import annotations

import threading
import time

import numpy as np

import fedpar.server.coordinator as coordinator_module
from fedpar.protocol.codec import ModelLayout
from fedpar.server.checkpoint import load_checkpoint

NAMES = ["w"]


def test_the_next_round_runs_while_a_checkpoint_is_written_and_its_close_waits_for_it(start_coordinator, agents,
                                                                                     tmp_path, monkeypatch):
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
                               checkpoint_dir=ckpt)
    at_each_row = []
    server.coordinator.on_round_end.append(lambda row: at_each_row.append((row["round"],
                                                                          load_checkpoint(ckpt).round_id)))
    (agent,) = agents(server.address, ["a"])
    layout = ModelLayout.of_arrays(NAMES, weights)
    for round_id in (1, 2, 3):
        task = agent.task()
        assert task.round == round_id
        if round_id == 2:  # round 2 is under way while round 1's checkpoint is still being written
            assert writing.is_set() and not (ckpt / "LATEST").exists() and at_each_row == []
        start = agent.download(task, layout)
        assert agent.upload(task, [w + round_id for w in start], 10, names=NAMES).accepted
        if round_id == 2:  # round 2 is in, but it does not finish before round 1 is written
            time.sleep(0.2)
            assert server.coordinator.round_id == 1 and not (ckpt / "LATEST").exists()
            release.set()
    assert server.wait(30)
    assert at_each_row == [(1, 1), (2, 2), (3, 3)]  # each line after its own round's checkpoint, in order
    rows = list(server.coordinator.metrics.read_rows())
    assert [r["round"] for r in rows] == [1, 2, 3]
    final = load_checkpoint(ckpt)
    assert final.round_id == 3 and final.state["metrics_row"]["round"] == 3
    assert np.array_equal(final.arrays[0], np.full(8, 6, np.float32))  # 0 + 1 + 2 + 3
