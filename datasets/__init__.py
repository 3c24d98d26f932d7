"""fedpar.datasets: digits (bundled), MNIST (npz or IDX folder), character-level text corpora, and each client's
share of a training set (``partition``: IID, Dirichlet, shards; ``clientdata``: local train/validation split)."""

from fedpar.datasets.arrays import ArrayDataset, DatasetSplits
from fedpar.datasets.digits import load_digits
from fedpar.datasets.idx import IdxFormatError, parse_idx, read_idx
from fedpar.datasets.mnist import load_mnist
from fedpar.datasets.registry import load_dataset
from fedpar.datasets.text import CharCorpus, load_text

__all__ = [
    "ArrayDataset",
    "CharCorpus",
    "DatasetSplits",
    "IdxFormatError",
    "load_dataset",
    "load_digits",
    "load_mnist",
    "load_text",
    "parse_idx",
    "read_idx",
]
