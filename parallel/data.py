"""Training data for the centralized trainer: zoo datasets as in-memory tensors, plus the matching model sizes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedpar.datasets import load_digits, load_mnist, load_text
from fedpar.datasets.mnist import EXPECTED_FILES, WHERE_TO_GET, check_mnist_folder

CLASSIFICATION = "classification"
LANGUAGE_MODEL = "language_model"
DATASETS = ("digits", "mnist", "text")


@dataclass
class TrainData:
    """Train and evaluation inputs/targets as tensors, and the task they pose."""

    train_inputs: torch.Tensor
    train_targets: torch.Tensor
    eval_inputs: torch.Tensor
    eval_targets: torch.Tensor
    task: str

    def __post_init__(self) -> None:
        """Check that inputs and targets pair up."""
        if len(self.train_inputs) != len(self.train_targets) or len(self.eval_inputs) != len(self.eval_targets):
            raise ValueError("inputs and targets must have the same number of examples")


def text_windows(tokens: np.ndarray, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows: inputs (n, block_size) and targets shifted one token ahead."""
    n = (len(tokens) - 1) // block_size
    if n < 1:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than block_size+1={block_size + 1}; "
                         "use a longer text or a smaller --block-size")
    t = torch.from_numpy(np.ascontiguousarray(tokens[: n * block_size + 1]))
    return t[:-1].view(n, block_size).clone(), t[1:].view(n, block_size).clone()


def check_data_source(dataset: str, data_path: str) -> None:
    """ValueError saying what to give when ``dataset`` needs --data-path and it is missing (or, for mnist, is not a
    folder of MNIST files); reads nothing, so the launcher checks it once before any rank starts."""
    name = dataset.lower()
    if name == "text" and not data_path:
        raise ValueError("--dataset text needs --data-path FILE (any UTF-8 text, e.g. "
                         "../shared/data/tinyshakespeare/input.txt)")
    if name == "mnist":
        if not data_path:
            raise ValueError(f"--dataset mnist needs --data-path DIR holding {EXPECTED_FILES}; {WHERE_TO_GET}")
        check_mnist_folder(data_path)


def load_train_data(dataset: str, data_path: str, block_size: int, seed: int) -> tuple[TrainData, dict[str, Any]]:
    """Load ``dataset`` and return it with the model keywords its shapes imply (input size, classes, vocab)."""
    check_data_source(dataset, data_path)
    name = dataset.lower()
    if name == "text":
        corpus = load_text(data_path, block_size)
        x, y = text_windows(corpus.train, block_size)
        vx, vy = text_windows(corpus.val, block_size)
        return TrainData(x, y, vx, vy, LANGUAGE_MODEL), {"vocab_size": corpus.vocab_size, "block_size": block_size}
    if name == "digits":
        splits = load_digits(seed=seed)
    elif name == "mnist":
        splits = load_mnist(data_path)
    else:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    x, y = splits.train.to_tensors()
    tx, ty = splits.test.to_tensors()
    shape = tuple(splits.input_shape)
    sizes = {"mlp": {"in_features": math.prod(shape), "num_classes": splits.num_classes},
             "cnn": {"in_channels": shape[0], "image_size": shape[-1], "num_classes": splits.num_classes}}
    return TrainData(x, y, tx, ty, CLASSIFICATION), sizes


def model_kwargs_for(model: str, implied: dict[str, Any], user: dict[str, Any]) -> dict[str, Any]:
    """Keywords for ``build_model``: what the data implies for ``model``, overridden by the user's."""
    base = implied.get(model, {}) if model in ("mlp", "cnn") else (
        implied if "vocab_size" in implied else {})
    if model == "gpt" and "vocab_size" not in implied:
        raise ValueError("the gpt model trains on --dataset text; the mlp and cnn models on digits or mnist")
    if model != "gpt" and "vocab_size" in implied:
        raise ValueError(f"--dataset text is a language-modelling corpus; use --model gpt, not {model}")
    return {**base, **user}
