"""Datasets by name, for every command: the classification sets "digits" (bundled), "mnist" (a local folder),
"synthetic:ALPHA:BETA[:CLIENTS[:SAMPLES]]", "npz:PATH" and "csv:PATH" as a train/test pair (simulate, serve, client,
simulate-workers and train), and "text", a character corpus for language models (train)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the loaders import torch; the names below are read by the command line without it
    from fedpar.datasets.arrays import DatasetSplits, TrainData

TEXT = "text"
# Every name load_dataset/load_train_data accepts, and what it is: --dataset's help is made of this table.
DATASETS = {
    "digits": "8x8 images bundled with scikit-learn",
    "mnist": "a local folder: --data-dir, train's --data-path",
    "synthetic[:ALPHA:BETA[:CLIENTS[:SAMPLES]]]": "FedProx's generated federation (synthetic:iid: its IID one)",
    "npz:PATH": "a table of features and labels",
    "csv:PATH": "a table of features and labels",
    TEXT: "a character corpus for language models: train --model gpt --data-path FILE",
}
_NAMES = tuple(DATASETS)
DATASET_HELP = "one of: " + ", ".join(f"{name} ({what})" for name, what in DATASETS.items())


def load_dataset(name: str, data_dir: str | Path | None = None, **kwargs: object) -> DatasetSplits:
    """Load classification set ``name``; digits takes test_fraction/seed keywords, mnist needs ``data_dir``,
    synthetic takes ``clients`` when its name does not say how many."""
    from fedpar.datasets.digits import load_digits
    from fedpar.datasets.mnist import EXPECTED_FILES, WHERE_TO_GET, load_mnist
    from fedpar.datasets.synthetic import SyntheticSpec, load_synthetic
    from fedpar.datasets.tables import load_csv_table, load_npz_table

    key = name.lower()
    if key == "digits":
        return load_digits(**kwargs)  # bundled with scikit-learn: data_dir is not used
    if key == "mnist":
        if data_dir is None:
            raise ValueError(f"mnist needs --data-dir DIR holding {EXPECTED_FILES}; {WHERE_TO_GET}")
        if kwargs:
            raise ValueError(f"mnist takes no options besides data_dir, got {sorted(kwargs)}")
        return load_mnist(data_dir)
    if key.startswith(("npz:", "csv:")):
        return (load_npz_table if key.startswith("npz:") else load_csv_table)(name[4:])
    if key.startswith("synthetic"):
        return load_synthetic(SyntheticSpec.parse(key, kwargs.pop("clients", None)))
    if key == TEXT:
        raise ValueError("text is a character corpus for language models, not a classification set: train the gpt "
                         "on it with fedpar train --model gpt --dataset text --data-path FILE, or federated with "
                         "--task fedpar.tasks.zoo:language_model --task-option data_path=FILE")
    raise ValueError(f"unknown dataset {name!r}; valid names are: {', '.join(_NAMES)}")


def load_train_data(name: str, data_path: str | Path | None, block_size: int, seed: int
                    ) -> tuple[TrainData, dict[str, Any]]:
    """Dataset ``name`` as tensors for the centralized trainer, and what its shapes tell the model: ``input_shape``
    and ``num_classes`` of a classification set, ``vocab_size`` and ``block_size`` of the text corpus at
    ``data_path`` (``block_size`` characters per window, the first 90% training)."""
    from fedpar.datasets.arrays import CLASSIFICATION, LANGUAGE_MODEL, TrainData
    from fedpar.datasets.mnist import EXPECTED_FILES, WHERE_TO_GET
    from fedpar.datasets.text import load_text, text_windows

    if name.lower() == TEXT:
        if not data_path:
            raise ValueError("--dataset text needs --data-path FILE (any UTF-8 text, e.g. "
                             "../shared/data/tinyshakespeare/input.txt)")
        corpus = load_text(data_path, block_size)
        x, y = text_windows(corpus.train, block_size)
        vx, vy = text_windows(corpus.val, block_size)
        return TrainData(x, y, vx, vy, LANGUAGE_MODEL), {"vocab_size": corpus.vocab_size, "block_size": block_size}
    if name.lower() == "mnist" and not data_path:
        raise ValueError(f"--dataset mnist needs --data-path DIR holding {EXPECTED_FILES}; {WHERE_TO_GET}")
    options = {"seed": seed} if name.lower() == "digits" else {}
    splits = load_dataset(name, data_path or None, **options)
    x, y = splits.train.to_tensors()
    tx, ty = splits.test.to_tensors()
    return (TrainData(x, y, tx, ty, CLASSIFICATION),
            {"input_shape": tuple(splits.input_shape), "num_classes": splits.num_classes})


def full_dataset_name(name: str, clients: int) -> str:
    """``name`` with what a federation of ``clients`` fills in (a synthetic dataset's client count)."""
    from fedpar.datasets.synthetic import SyntheticSpec

    return SyntheticSpec.parse(name.lower(), clients).name if name.lower().startswith("synthetic") else name
