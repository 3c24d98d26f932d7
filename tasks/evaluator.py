"""The coordinator's central evaluation of a task: each new global model scored on the task's test data."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fedpar.models.weights import set_weights
from fedpar.task import Task
from fedpar.tasks.data import on_device
from fedpar.tasks.evaluation import evaluate_task, finite


class TaskEvaluator:
    """Scores weights with the task's evaluation on its test set, both kept on ``device``; metrics are named
    ``test_NAME`` (``test_loss``, ``test_accuracy`` for the built-in classifiers)."""

    def __init__(self, task: Task, test_data: Any, device: torch.device | str = "cpu"):
        """Build the task's model once and keep it and ``test_data`` on ``device``."""
        self.task = task
        self.device = torch.device(device)
        self.model = task.model().to(self.device)
        self.data = on_device(test_data, self.device)

    def __call__(self, weights: Sequence[np.ndarray]) -> dict[str, float]:
        """The named metrics of the model with ``weights``, each as ``test_NAME``."""
        set_weights(self.model, weights)
        return {f"test_{k}": v for k, v in finite(evaluate_task(self.task, self.model, self.data)).items()}
