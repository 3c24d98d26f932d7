"""In-memory labelled datasets as numpy arrays, a train/test pair with its metadata, and a training and an
evaluation set as the tensors the centralized trainer reads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ArrayDataset:
    """Examples ``x`` (float32, first axis = example) with integer labels ``y`` (int64)."""

    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        """Convert x to float32 and y to int64 and check that they hold the same number of examples."""
        self.x = np.ascontiguousarray(self.x, dtype=np.float32)
        self.y = np.ascontiguousarray(self.y, dtype=np.int64)
        if self.y.ndim != 1:
            raise ValueError(f"labels must be one-dimensional, got shape {self.y.shape}")
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"x has {self.x.shape[0]} examples but y has {self.y.shape[0]} labels")

    def __len__(self) -> int:
        """Number of examples."""
        return int(self.y.shape[0])

    def subset(self, indices: np.ndarray | list[int]) -> ArrayDataset:
        """A new dataset holding copies of the examples at ``indices`` (in that order)."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.ndim != 1:
            raise ValueError(f"indices must be one-dimensional, got shape {idx.shape}")
        if idx.size and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise ValueError(f"indices must lie in [0, {len(self)}), got range [{idx.min()}, {idx.max()}]")
        return ArrayDataset(self.x[idx], self.y[idx])

    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) as torch tensors sharing memory with the arrays (float32, int64)."""
        return torch.from_numpy(self.x), torch.from_numpy(self.y)


@dataclass
class DatasetSplits:
    """A train and a test set, the number of classes and the shape of one input example."""

    train: ArrayDataset
    test: ArrayDataset
    num_classes: int
    input_shape: tuple[int, ...]
    train_owners: np.ndarray | None = None  # the client each training example belongs to, where data has owners


CLASSIFICATION = "classification"
LANGUAGE_MODEL = "language_model"


@dataclass
class TrainData:
    """Train and evaluation inputs/targets as tensors, and the task they pose (CLASSIFICATION or LANGUAGE_MODEL)."""

    train_inputs: torch.Tensor
    train_targets: torch.Tensor
    eval_inputs: torch.Tensor
    eval_targets: torch.Tensor
    task: str

    def __post_init__(self) -> None:
        """Check that inputs and targets pair up."""
        if len(self.train_inputs) != len(self.train_targets) or len(self.eval_inputs) != len(self.eval_targets):
            raise ValueError("inputs and targets must have the same number of examples")
