"""Every trainer implements the one Trainer protocol the runtime drives (no feature probes): each member of the
protocol is there, with train's parameters, and built trainers pass isinstance(trainer, Trainer)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from torch import nn

from fedpar.client.engine_trainer import EngineTrainer
from fedpar.client.flower_app_member import FlowerAppTrainer
from fedpar.client.flower_client import FlowerTrainer
from fedpar.client.task_trainer import TaskTrainer
from fedpar.client.trainer import LocalTrainer
from fedpar.client.trainer_protocol import Trainer
from fedpar.datasets import ArrayDataset
from fedpar.simulations.client_batching import BatchedTrainer, ClientBatcher
from fedpar.task import ClientData
from fedpar.tasks.zoo import classifier_module

TRAINERS = [TaskTrainer, LocalTrainer, BatchedTrainer, EngineTrainer, FlowerTrainer, FlowerAppTrainer]
MEMBERS = sorted({*Trainer.__annotations__, *(n for n in vars(Trainer) if not n.startswith("_"))})


@pytest.mark.parametrize("cls", TRAINERS, ids=lambda c: c.__name__)
def test_each_trainer_class_declares_every_member_of_the_protocol(cls):
    assert set(MEMBERS) >= {"framework", "reads_task_settings", "evaluates_together", "survives_failed_training",
                            "num_examples", "train", "evaluate", "evaluate_splits", "warm_up", "holding_task",
                            "tasks_queued", "call_off", "array_specs", "set_arrays", "get_arrays"}
    assert isinstance(cls.framework, str) and isinstance(cls.reads_task_settings, bool)
    assert isinstance(cls.evaluates_together, bool)
    assert cls.survives_failed_training is (cls is not EngineTrainer)  # an engine's ranks fail together
    for name in MEMBERS:
        if name != "num_examples":  # FlowerTrainer sets it on the instance (it is asked for when it is built)
            assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
    wanted = inspect.signature(Trainer.train).parameters
    got = inspect.signature(cls.train).parameters
    assert list(got)[:len(wanted)] == list(wanted), cls.__name__  # the runtime may pass any of them by name


def test_built_trainers_are_trainers():
    x = np.random.default_rng(0).standard_normal((20, 4)).astype(np.float32)
    data = ArrayDataset(x, np.arange(20) % 3)
    task = classifier_module(nn.Linear(4, 3))
    trainers = [TaskTrainer(task, ClientData(data)), LocalTrainer(nn.Linear(4, 3), data),
                BatchedTrainer(task, ClientData(data), ClientBatcher())]
    for trainer in trainers:
        assert isinstance(trainer, Trainer)
        assert trainer.num_examples == 20 and trainer.framework == "torch" and not trainer.reads_task_settings
        trainer.set_arrays([np.zeros(s, np.float32) for _, _, s in trainer.array_specs()])
        assert all(not a.any() for a in trainer.get_arrays())
    assert not isinstance(torch.nn.Linear(2, 2), Trainer)
