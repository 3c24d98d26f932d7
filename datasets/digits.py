"""scikit-learn's bundled 8x8 handwritten digits (1,797 images; no download)."""

from __future__ import annotations

import numpy as np

from fedpar.datasets.arrays import ArrayDataset, DatasetSplits


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> DatasetSplits:
    """Digits as (N, 1, 8, 8) float32 in [0, 1], split into train/test stratified by label with ``seed``."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be between 0 and 1 (exclusive), got {test_fraction}")
    # Imported here: scikit-learn takes seconds to import and only this loader needs it.
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    bunch = sklearn_digits()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = bunch.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y)
    return DatasetSplits(ArrayDataset(x_train, y_train), ArrayDataset(x_test, y_test),
                         num_classes=10, input_shape=(1, 8, 8))
