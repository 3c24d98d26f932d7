"""Local training of a PyTorch classifier on in-memory arrays that never leave the agent: the zoo's task."""

from __future__ import annotations

import threading

import torch
from torch import nn

from fedpar.client.task_trainer import TaskTrainer
from fedpar.datasets import ArrayDataset
from fedpar.parallel.config import PRECISIONS
from fedpar.task import ClientData
from fedpar.tasks.zoo import classifier_module

__all__ = ["LocalTrainer", "PRECISIONS"]


class LocalTrainer(TaskTrainer):
    """A :class:`TaskTrainer` of the zoo's kind of task (``fedpar.tasks.zoo.classifier_module``): the classifier
    ``model`` trained with cross-entropy and plain SGD on the arrays ``train``, scored on ``val``, stopping before a
    wall-clock limit.

    The model and the data live on ``device`` for the trainer's life; ``precision="bf16"`` runs forward passes under
    bf16 autocast (weights, gradients and the update stay fp32, so uploads are unchanged). ``compute_lock`` and
    ``seconds_per_step_delay``: see TaskTrainer.
    """

    def __init__(self, model: nn.Module, train: ArrayDataset, val: ArrayDataset | None = None,
                 seed: int = 0, seconds_per_step_delay: float = 0.0,
                 compute_lock: threading.Lock | None = None, device: torch.device | str = "cpu",
                 precision: str = "fp32"):
        super().__init__(classifier_module(model), ClientData(train, val), seed, device, precision,
                         seconds_per_step_delay, compute_lock, model=model)

    @property
    def x(self) -> torch.Tensor:
        """The local training inputs, on the device."""
        return self.data.train.tensors[0]

    @property
    def y(self) -> torch.Tensor:
        """The local training labels, on the device."""
        return self.data.train.tensors[1]
