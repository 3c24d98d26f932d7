"""Datasets by name, for every command: the ones the dataset modules register (datasets/catalog.py), e.g. the
classification sets "digits" (bundled), "mnist" (a local folder), "synthetic:ALPHA:BETA[:CLIENTS[:SAMPLES]]",
"npz:PATH" and "csv:PATH" as a train/test pair (simulate, serve, client, simulate-workers and train), and "text", a
character corpus for language models (train)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedpar.datasets.catalog import Dataset, dataset_entries

if TYPE_CHECKING:  # the loaders import torch; the names below are read by the command line without it
    from fedpar.datasets.arrays import DatasetSplits, TrainData

# Every name load_dataset/load_train_data accepts, and what it is: --dataset's help is made of this table.
DATASETS = {entry.usage: entry.help for entry in dataset_entries()}
DATASET_HELP = "one of: " + ", ".join(f"{name} ({what})" for name, what in DATASETS.items())


def dataset_entry(name: str) -> Dataset:
    """The registered dataset ``name`` names; ValueError listing the valid names when none does."""
    if not isinstance(name, str):
        raise TypeError(f"a dataset is named by text, one of: {', '.join(DATASETS)}; got {name!r}")
    key = name.lower()
    for entry in dataset_entries():
        if entry.matches(key):
            return entry
    raise ValueError(f"unknown dataset {name!r}; valid names are: {', '.join(DATASETS)}")


def load_dataset(name: str, data_dir: str | Path | None = None, **kwargs: object) -> DatasetSplits:
    """Load classification set ``name`` with its loader's options (digits: test_fraction/seed; synthetic: clients,
    when its name does not say how many); a dataset that reads a folder (mnist) needs ``data_dir``."""
    entry = dataset_entry(name)
    if entry.folder and data_dir is None:
        raise ValueError(f"{entry.name} needs --data-dir DIR holding {entry.folder}")
    unknown = sorted(k for k in kwargs if not entry.takes(k))
    if unknown:
        raise ValueError(f"dataset {entry.name} takes no option {', '.join(unknown)}")
    if entry.takes("data_dir"):
        kwargs["data_dir"] = data_dir
    return entry.load(name, **kwargs)


def load_train_data(name: str, data_path: str | Path | None, block_size: int, seed: int
                    ) -> tuple[TrainData, dict[str, Any]]:
    """Dataset ``name`` as tensors for the centralized trainer, and what its shapes tell the model: ``input_shape``
    and ``num_classes`` of a classification set (``seed`` to a loader that takes one), or what the dataset's own
    ``train`` says (the text corpus: ``vocab_size`` and ``block_size``)."""
    from fedpar.datasets.arrays import CLASSIFICATION, TrainData

    entry = dataset_entry(name)
    if entry.train is not None:
        return entry.train(name, data_path, block_size, seed)
    if entry.folder and not data_path:
        raise ValueError(f"--dataset {entry.name} needs --data-path DIR holding {entry.folder}")
    # centralized: what a loader of a federation (synthetic) then fills in when the name does not say how many clients
    options = {key: value for key, value in (("seed", seed), ("centralized", True)) if entry.takes(key)}
    splits = load_dataset(name, data_path or None, **options)
    x, y = splits.train.to_tensors()
    tx, ty = splits.test.to_tensors()
    return (TrainData(x, y, tx, ty, CLASSIFICATION),
            {"input_shape": tuple(splits.input_shape), "num_classes": splits.num_classes})


def full_dataset_name(name: str, clients: int) -> str:
    """``name`` with what a federation of ``clients`` fills in (a synthetic dataset's client count)."""
    entry = next((e for e in dataset_entries() if e.matches(name.lower())), None)
    return entry.full_name(name, clients) if entry is not None and entry.full_name is not None else name


def check_dataset_fits(name: str, processes: int, partition: str = "auto") -> None:
    """ValueError, one line, when ``processes`` processes each loading dataset ``name`` (its full name: see
    :func:`full_dataset_name`) split by ``partition`` need more memory than this machine has available (for
    datasets that say: synthetic's is generated, so its name alone sets its size)."""
    entry = next((e for e in dataset_entries() if e.matches(name.lower())), None)
    if entry is not None and entry.fits is not None:
        entry.fits(name, processes, partition)
