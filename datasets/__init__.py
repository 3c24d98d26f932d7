"""fedpar.datasets: digits (bundled), MNIST (npz or IDX folder), character-level text corpora, and each client's
share of a training set (``partition``: IID, Dirichlet, shards; ``clientdata``: local train/validation split;
``members``: each client's examples, made only when it is asked for).

Its names are imported on first use, so that the command line can read the dataset registry's names and the
data settings (``fedpar.datasets.settings``) without importing torch.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "ArrayDataset": "arrays", "DatasetSplits": "arrays", "load_digits": "digits", "IdxFormatError": "idx",
    "parse_idx": "idx", "read_idx": "idx", "load_mnist": "mnist", "load_dataset": "registry", "CharCorpus": "text",
    "load_text": "text",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    """``fedpar.datasets.NAME``, imported from its module on first use."""
    if name not in _HOMES:
        raise AttributeError(f"module 'fedpar.datasets' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"fedpar.datasets.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
