"""Checks run on every rank of one 2-rank gloo group (see test_engine_trainer.py): the EngineTrainer's numerics
under DDP, TP and FSDP against one process, and a deadline that all ranks obey together."""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fedpar.client.engine_trainer import EngineTrainer
from fedpar.client.trainer import LocalTrainer
from fedpar.datasets import load_dataset
from fedpar.models import get_weights, set_weights
from fedpar.models.for_data import build_model_for_data
from fedpar.parallel.config import ParallelConfig
from fedpar.parallel.init import init_distributed
from fedpar.datasets.clientdata import local_split, partition_indices
from fedpar.task import ClientData
from fedpar.tasks.zoo import classifier_for

SPLITS = load_dataset("digits")
TRAIN, VAL = local_split(SPLITS.train, partition_indices(SPLITS, "iid", 5, 0)[0], 0.1, 0)  # 259: odd


def _model() -> torch.nn.Module:
    return build_model_for_data("mlp", SPLITS.input_shape, SPLITS.num_classes)


def _start() -> list[np.ndarray]:
    torch.manual_seed(7)
    return get_weights(_model())


def _engine(**degrees) -> EngineTrainer:
    config = ParallelConfig(**degrees, sequence_parallel=False)
    return EngineTrainer(classifier_for("mlp", SPLITS), ClientData(TRAIN, VAL), init_distributed(), config,
                         shuffle=False, idle_timeout_seconds=60)


def _drive(trainer: EngineTrainer, start: list[np.ndarray], *train_args, **train_kwargs):
    """Rank 0 trains from ``start`` and returns (result, weights); the other ranks follow and return None."""
    if dist.get_rank() != 0:
        trainer.follow()
        return None
    set_weights(trainer.model, start)
    result = trainer.train(*train_args, **train_kwargs)
    trainer.shutdown()
    return result, get_weights(trainer.model)


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _sequential(start: list[np.ndarray], epochs: int, batch: int, lr: float) -> list[np.ndarray]:
    """One process, SGD over the examples in order in batches of ``batch`` (the last one smaller)."""
    model = _model()
    set_weights(model, start)
    x, y = TRAIN.to_tensors()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        for b in range(0, len(y), batch):
            optimizer.zero_grad()
            F.cross_entropy(model(x[b:b + batch]), y[b:b + batch]).backward()
            optimizer.step()
    return get_weights(model)


def check_ddp_minibatches_with_padding_equal_one_process() -> dict:
    """dp=2, batch 78 (39 per rank): the last global batch has 25 real examples, so rank 1 trains on padding only."""
    start = _start()
    out = _drive(_engine(dp=2), start, 2, 78, 0.1)
    if out is None:
        return {}
    result, weights = out
    return {"max_diff": _max_diff(weights, _sequential(start, 2, 78, 0.1)), "examples": result.examples,
            "steps": result.steps}


def check_tp_fedprox_full_batch_equals_local_trainer() -> dict:
    """tp=2 (column- then row-wise Linear), full batch, FedProx mu: equals LocalTrainer on one process."""
    start = _start()
    out = _drive(_engine(dp=1, tp=2), start, 3, 10_000, 0.1, proximal_mu=0.5)
    if out is None:
        return {}
    result, weights = out
    model = _model()
    set_weights(model, start)
    reference = LocalTrainer(model, TRAIN).train(3, 10_000, 0.1, proximal_mu=0.5)
    return {"max_diff": _max_diff(weights, get_weights(model)), "examples": result.examples,
            "reference_examples": reference.examples, "loss_diff": abs(result.loss - reference.loss)}


def check_fsdp_deadline_stops_every_rank_together() -> dict:
    """fsdp=2, far more epochs than fit before the deadline: all ranks stop at rank 0's step, then a task with
    no time left returns at once without involving the others, and shutdown still releases them."""
    trainer, start = _engine(dp=1, fsdp=2), _start()
    if dist.get_rank() != 0:
        trainer.follow()
        return {"followed": 1}
    set_weights(trainer.model, start)
    began = time.monotonic()
    result = trainer.train(10_000, 10, 0.05, stop_at=began + 1.0)
    elapsed = time.monotonic() - began
    late = trainer.train(1, 10, 0.05, stop_at=time.monotonic() - 1.0)
    trainer.shutdown()
    return {"stopped_early": int(result.stopped_early), "steps": result.steps, "examples": result.examples,
            "elapsed": elapsed, "late_examples": late.examples,
            "changed": _max_diff(get_weights(trainer.model), start)}
