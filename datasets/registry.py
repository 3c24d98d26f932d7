"""Load the image-classification datasets by name: "digits" (bundled) and "mnist" (local folder)."""

from __future__ import annotations

from pathlib import Path

from fedpar.datasets.arrays import DatasetSplits
from fedpar.datasets.digits import load_digits
from fedpar.datasets.mnist import EXPECTED_FILES, load_mnist

_NAMES = ("digits", "mnist")


def load_dataset(name: str, data_dir: str | Path | None = None, **kwargs: object) -> DatasetSplits:
    """Load ``name``; digits takes test_fraction/seed keywords, mnist needs ``data_dir``."""
    key = name.lower()
    if key == "digits":
        return load_digits(**kwargs)  # bundled with scikit-learn: data_dir is not used
    if key == "mnist":
        if data_dir is None:
            raise ValueError(f"mnist needs --data-dir pointing at a folder with {EXPECTED_FILES}")
        if kwargs:
            raise ValueError(f"mnist takes no options besides data_dir, got {sorted(kwargs)}")
        return load_mnist(data_dir)
    raise ValueError(f"unknown dataset {name!r}; valid names are: {', '.join(_NAMES)}")
