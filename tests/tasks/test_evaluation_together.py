"""Federated evaluation of several members at once: a host's seat scores the round's global model on its members'
validation splits in one pass (tasks/evaluation.py task_eval_results), with the same figures as each member's own
evaluation; a task with its own evaluate hook, or data not in memory, is scored member by member."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedpar import ClientData
from fedpar.client.task_trainer import TaskTrainer
from fedpar.datasets import ArrayDataset
from fedpar.task import Task
from fedpar.tasks.zoo import classifier_module


def _split(n: int, seed: int) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    return ArrayDataset(rng.standard_normal((n, 8)).astype(np.float32), rng.integers(0, 4, n))


def _trainer(task: Task) -> TaskTrainer:
    trainer = TaskTrainer(task, ClientData(_split(30, 99)), seed=0)
    torch.manual_seed(1)
    trainer.set_arrays([np.random.default_rng(3).standard_normal(s).astype(np.float32)
                        for _, _, s in trainer.array_specs()])
    return trainer


def _one_by_one(trainer: TaskTrainer, splits: list) -> list:
    """Each split scored as its member's own evaluate does (the member's data taken on by the seat)."""
    results = []
    for k, split in enumerate(splits):
        trainer.use_data(ClientData(_split(5, 50 + k), split), seed=k)
        results.append(trainer.evaluate())
    return results


def _assert_same(together: list, alone: list) -> None:
    assert len(together) == len(alone)
    for a, b in zip(together, alone):
        if b is None:
            assert a is None
            continue
        assert a.examples == b.examples and a.metrics == pytest.approx(b.metrics, rel=1e-5)
        assert a.loss == pytest.approx(b.loss, rel=1e-5, abs=1e-7)
        assert a.accuracy == b.accuracy


def test_members_scored_in_one_pass_get_their_own_evaluation_figures():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 4))  # eval mode: no dropout
    trainer = _trainer(classifier_module(model))
    splits = [_split(37, 1), None, _split(1500, 2), _split(0, 3), _split(1, 4), _split(1030, 5)]  # across batches
    together = trainer.evaluate_splits(splits)
    _assert_same(together, _one_by_one(trainer, splits))
    assert [r is None for r in together] == [False, True, False, True, False, False]
    assert together[2].examples == 1500 and 0.0 <= together[2].accuracy <= 1.0
    assert trainer.model.training  # left as training found it


def test_a_task_with_its_own_evaluate_hook_is_scored_member_by_member_with_its_metrics():
    base = classifier_module(nn.Linear(8, 4))
    calls = []

    def evaluate(model, dataset):
        calls.append(len(dataset))
        x, y = dataset.tensors  # as the member's own evaluate gets it
        return {"loss": float(nn.functional.cross_entropy(model(x), y)), "mean_label": float(y.float().mean())}

    task = Task(model=base.model, client_data=base.client_data, loss=base.loss, evaluate=evaluate, name="hooked")
    trainer = _trainer(task)
    splits = [_split(12, 1), _split(20, 2)]
    together = trainer.evaluate_splits(splits)
    assert calls == [12, 20]
    _assert_same(together, _one_by_one(trainer, splits))
    assert together[1].accuracy is None and set(together[1].metrics) == {"mean_label"}
