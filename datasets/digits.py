"""scikit-learn's bundled 8x8 handwritten digits (1,797 images; no download)."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np

from fedpar.datasets.arrays import ArrayDataset, DatasetSplits
from fedpar.datasets.catalog import register_dataset


def _read_digits() -> tuple[np.ndarray, np.ndarray]:
    """Pixels (1797, 64) in 0..16 and labels, read from scikit-learn's bundled digits.csv.gz.

    Reading the file directly avoids importing sklearn.datasets (and scipy), which takes seconds.
    """
    spec = importlib.util.find_spec("sklearn")
    csv = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if csv is not None and csv.is_file():
        with gzip.open(csv, "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.float64)
        return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as sklearn_digits  # the file moved: use the public API

    bunch = sklearn_digits()
    return bunch.data, bunch.target.astype(np.int64)


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) indices with ceil(test_fraction * N) test examples, each class split pro rata."""
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    n_test = int(np.ceil(test_fraction * len(labels)))
    exact = counts * (n_test / len(labels))
    take = np.floor(exact).astype(np.int64)
    # Largest remainders get the leftover test slots (ties broken at random), so the total is exact.
    leftover = n_test - int(take.sum())
    order = np.lexsort((rng.random(len(classes)), -(exact - take)))
    take[order[:leftover]] += 1
    test_parts = [rng.permutation(np.flatnonzero(labels == c))[:k] for c, k in zip(classes, take)]
    test = np.sort(np.concatenate(test_parts))
    train = np.setdiff1d(np.arange(len(labels)), test)
    return train, test


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> DatasetSplits:
    """Digits as (N, 1, 8, 8) float32 in [0, 1], split into train/test stratified by label with ``seed``."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be between 0 and 1 (exclusive), got {test_fraction}")
    pixels, y = _read_digits()
    x = (pixels.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    train, test = stratified_split(y, test_fraction, seed)
    return DatasetSplits(ArrayDataset(x[train], y[train]), ArrayDataset(x[test], y[test]),
                         num_classes=10, input_shape=(1, 8, 8))


@register_dataset("digits", help="8x8 images bundled with scikit-learn")
def digits_dataset(name: str, test_fraction: float = 0.2, seed: int = 0) -> DatasetSplits:
    """``--dataset digits`` (bundled with scikit-learn: no folder)."""
    return load_digits(test_fraction, seed)
