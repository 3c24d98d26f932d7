"""Load the image-classification datasets by name: "digits" (bundled) and "mnist" (local folder)."""

from __future__ import annotations

from pathlib import Path

from fedpar.datasets.arrays import DatasetSplits
from fedpar.datasets.digits import load_digits
from fedpar.datasets.mnist import EXPECTED_FILES, WHERE_TO_GET, load_mnist
from fedpar.datasets.synthetic import SyntheticSpec, load_synthetic
from fedpar.datasets.tables import load_csv_table, load_npz_table

_NAMES = ("digits", "mnist", "synthetic:ALPHA:BETA[:CLIENTS[:SAMPLES]]", "npz:PATH", "csv:PATH")


def load_dataset(name: str, data_dir: str | Path | None = None, **kwargs: object) -> DatasetSplits:
    """Load ``name``; digits takes test_fraction/seed keywords, mnist needs ``data_dir``, synthetic takes
    ``clients`` when its name does not say how many."""
    key = name.lower()
    if key == "digits":
        return load_digits(**kwargs)  # bundled with scikit-learn: data_dir is not used
    if key == "mnist":
        if data_dir is None:
            raise ValueError(f"mnist needs --data-dir pointing at a folder with {EXPECTED_FILES}; {WHERE_TO_GET}")
        if kwargs:
            raise ValueError(f"mnist takes no options besides data_dir, got {sorted(kwargs)}")
        return load_mnist(data_dir)
    if key.startswith(("npz:", "csv:")):
        return (load_npz_table if key.startswith("npz:") else load_csv_table)(name[4:])
    if key.startswith("synthetic"):
        return load_synthetic(SyntheticSpec.parse(key, kwargs.pop("clients", None)))
    raise ValueError(f"unknown dataset {name!r}; valid names are: {', '.join(_NAMES)}")


def full_dataset_name(name: str, clients: int) -> str:
    """``name`` with what a federation of ``clients`` fills in (a synthetic dataset's client count)."""
    return SyntheticSpec.parse(name.lower(), clients).name if name.lower().startswith("synthetic") else name
