"""Labelled datasets as numpy arrays (in memory; uint8 images decoded only for the rows asked for; made when first
read), a train/test pair with its metadata, and a training and an evaluation set as the tensors the centralized
trainer reads."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Union

import numpy as np

if TYPE_CHECKING:  # torch is imported where tensors are made: the dataset modules import this one to declare
    import torch  # their names, which the command line reads without torch


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

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Example ``index`` as (input float32 tensor, int64 label tensor), one row of a batch of ``to_tensors``."""
        import torch

        return torch.as_tensor(self.x[index]), torch.as_tensor(self.y[index])

    def subset(self, indices: np.ndarray | list[int]) -> ArrayDataset:
        """A new dataset holding copies of the examples at ``indices`` (in that order)."""
        idx = checked_indices(indices, len(self))
        return ArrayDataset(self.x[idx], self.y[idx])

    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) as torch tensors sharing memory with the arrays (float32, int64)."""
        import torch

        return torch.from_numpy(self.x), torch.from_numpy(self.y)

    def whole(self) -> ArrayDataset:
        """Every example (this dataset itself)."""
        return self


def checked_indices(indices: np.ndarray | list[int], length: int) -> np.ndarray:
    """``indices`` as a 1-D int64 array, ValueError unless each lies in [-length, length)."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.ndim != 1:
        raise ValueError(f"indices must be one-dimensional, got shape {idx.shape}")
    if idx.size and (idx.min() < -length or idx.max() >= length):
        raise ValueError(f"indices must lie in [0, {length}), got range [{idx.min()}, {idx.max()}]")
    return idx


class ByteImages:
    """uint8 images (N, H, W), e.g. a read-only memory map that every process shares, decoded to float32
    (N, 1, H, W) through a 256-entry ``table`` only for the rows asked for; labels ``y`` (int64) in memory."""

    def __init__(self, images: np.ndarray, y: np.ndarray, table: np.ndarray):
        self.images, self.y, self.table = images, np.ascontiguousarray(y, dtype=np.int64), table
        if len(self.images) != len(self.y):
            raise ValueError(f"{len(self.images)} images but {len(self.y)} labels")

    def __len__(self) -> int:
        """Number of examples."""
        return int(self.y.shape[0])

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of one decoded example."""
        return (1, *self.images.shape[1:])

    def subset(self, indices: np.ndarray | list[int]) -> ArrayDataset:
        """The examples at ``indices`` (in that order), decoded."""
        idx = checked_indices(indices, len(self))
        return ArrayDataset(self.table[self.images[idx]][:, None], self.y[idx])

    @property
    def x(self) -> np.ndarray:
        """Every example's inputs, decoded (a copy in memory each time: read ``subset`` of the rows needed)."""
        return self.whole().x

    def whole(self) -> ArrayDataset:
        """Every example, decoded (a copy in memory)."""
        return ArrayDataset(self.table[self.images][:, None], self.y)

    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of every example, decoded, as torch tensors."""
        return self.whole().to_tensors()


class LazyDataset:
    """An :class:`ArrayDataset` of ``length`` examples made by ``make()`` when its examples are first read (e.g. a
    generated federation pooled, which a run that reads members one at a time never needs)."""

    def __init__(self, make: Callable[[], ArrayDataset], length: int):
        self._make, self._length = make, length

    @functools.cached_property
    def data(self) -> ArrayDataset:
        """The examples, made now if not yet."""
        return self._make()

    def __len__(self) -> int:
        """Number of examples (known without making them)."""
        return self._length

    @property
    def x(self) -> np.ndarray:
        """The inputs (made now if not yet)."""
        return self.data.x

    @property
    def y(self) -> np.ndarray:
        """The labels (made now if not yet)."""
        return self.data.y

    def subset(self, indices: np.ndarray | list[int]) -> ArrayDataset:
        """A copy of the examples at ``indices``."""
        return self.data.subset(indices)

    def whole(self) -> ArrayDataset:
        """Every example."""
        return self.data

    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) as torch tensors."""
        return self.data.to_tensors()


# Any of them: each has __len__, y, subset(indices) -> ArrayDataset, whole() and to_tensors().
Examples = Union[ArrayDataset, ByteImages, LazyDataset]


@dataclass
class DatasetSplits:
    """A train and a test set, the number of classes and the shape of one input example."""

    train: Examples
    test: Examples
    num_classes: int
    input_shape: tuple[int, ...]
    train_owners: np.ndarray | None = None  # the client each training example belongs to, where data has owners
    members: object | None = None  # data that makes each of its own clients' examples by itself (MemberSource)


OUT_OF_SCALE = 1e3  # standardised features lie within a few units; raw amounts (money, counts) past this diverge


def scale_hint(inputs: object) -> str:
    """Why a loss that went NaN likely did when the floating-point features ``inputs`` (an array, a tensor, or a
    dataset holding one as ``x`` or as the first of its ``tensors``) are far out of scale; "" when they are not, or
    are no such features."""
    x = getattr(inputs, "x", inputs)
    tensors = getattr(x, "tensors", None)  # a TensorDataset of (inputs, labels), as a trainer keeps a member's
    if isinstance(tensors, tuple) and tensors:
        x = tensors[0]
    if hasattr(x, "is_floating_point"):  # a tensor (a rank's, on its device): only its largest magnitude is read
        largest = float(x.detach().abs().max()) if x.is_floating_point() and x.numel() else None
    elif isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.floating) and x.size:
        largest = float(np.max(np.abs(x)))
    else:  # token ids, images decoded on demand, a task's own data: no scale to read
        largest = None
    if largest is None or not largest >= OUT_OF_SCALE:
        return ""
    return (f"likely because the features are far out of scale (they reach {largest:.3g}): standardise each "
            "feature (e.g. to mean 0 and sd 1, with the same statistics at every site)")


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
