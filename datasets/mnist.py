"""MNIST from a local folder: train.npz/test.npz (keys x, y) or the four original IDX files (plain or .gz)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedpar.datasets.arrays import ArrayDataset, DatasetSplits
from fedpar.datasets.idx import read_idx

MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
NPZ_FILES = {"train": "train.npz", "test": "test.npz"}
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
EXPECTED_FILES = ("train.npz and test.npz (arrays x uint8 [N,28,28] and y [N]), or the IDX files "
                  "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
                  "t10k-labels-idx1-ubyte (each may end in .gz)")
WHERE_TO_GET = ("download the four IDX .gz files from https://ossci-datasets.s3.amazonaws.com/mnist/ (the mirror "
                "torchvision uses of yann.lecun.com/exdb/mnist) into that folder")


def normalize_mnist(images: np.ndarray) -> np.ndarray:
    """uint8 images (N, H, W) to float32 (N, 1, H, W) standardised with the usual MNIST mean and std."""
    # A 256-entry lookup table: one gather instead of a cast and three passes over 188 MB of floats.
    table = ((np.arange(256, dtype=np.float32) / np.float32(255.0) - np.float32(MNIST_MEAN))
             / np.float32(MNIST_STD)).astype(np.float32)
    return table[images][:, None, :, :]


def _check_pair(images: np.ndarray, labels: np.ndarray, source: str) -> None:
    if images.dtype != np.uint8 or images.ndim != 3:
        raise ValueError(f"{source}: images must be uint8 with shape (N, H, W), got {images.dtype} {images.shape}")
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{source}: labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{source}: {images.shape[0]} images but {labels.shape[0]} labels")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{source}: labels must be digits 0..9, found range [{labels.min()}, {labels.max()}]")


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = {"x", "y"} - set(data.files)
            if missing:
                raise ValueError(f"{path}: missing arrays {sorted(missing)}; expected keys x (images) and y (labels)")
            return data["x"], data["y"]
    except ValueError as exc:
        if "allow_pickle" in str(exc):
            raise ValueError(f"{path} stores object arrays, which need pickle and are refused; save x and y as "
                             "plain uint8/integer arrays (np.savez(path, x=images, y=labels))") from exc
        raise
    except Exception as exc:  # zipfile.BadZipFile, OSError, ...: all mean "not a readable npz"
        raise ValueError(f"{path}: cannot read as .npz ({exc})") from exc


def _find_idx(folder: Path, name: str) -> Path | None:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _load_split(folder: Path, split: str, use_npz: bool) -> ArrayDataset:
    if use_npz:
        path = folder / NPZ_FILES[split]
        images, labels = _read_npz(path)
        source = str(path)
    else:
        image_path, label_path = (_find_idx(folder, n) for n in IDX_FILES[split])
        assert image_path is not None and label_path is not None  # checked by check_mnist_folder
        images, labels = read_idx(image_path), read_idx(label_path)
        source = f"{image_path.name} + {label_path.name}"
    _check_pair(images, labels, source)
    return ArrayDataset(normalize_mnist(images), labels.astype(np.int64))


def check_mnist_folder(data_dir: str | Path) -> bool:
    """True when ``data_dir`` holds MNIST as train.npz/test.npz, False when as the IDX files; ValueError saying which
    files are expected and where to get them when the folder or its files are missing (nothing is read)."""
    folder = Path(data_dir)
    if not folder.is_dir():
        raise ValueError(f"MNIST folder {folder} does not exist; point it at a folder with {EXPECTED_FILES}, or "
                         f"{WHERE_TO_GET}")
    if all((folder / f).is_file() for f in NPZ_FILES.values()):
        return True
    if all(_find_idx(folder, n) is not None for pair in IDX_FILES.values() for n in pair):
        return False
    present = sorted(p.name for p in folder.iterdir())
    held = f"it holds {', '.join(present[:10])}{', ...' if len(present) > 10 else ''}" if present else "it is empty"
    raise ValueError(f"no MNIST files in {folder} ({held}); expected {EXPECTED_FILES}: {WHERE_TO_GET}")


def load_mnist(data_dir: str | Path) -> DatasetSplits:
    """MNIST from ``data_dir`` as (N, 1, 28, 28) float32 standardised images; npz files win over IDX files
    (ValueError as :func:`check_mnist_folder` says when they are missing)."""
    folder = Path(data_dir)
    has_npz = check_mnist_folder(folder)
    train = _load_split(folder, "train", has_npz)
    test = _load_split(folder, "test", has_npz)
    if train.x.shape[1:] != test.x.shape[1:]:
        raise ValueError(f"train images {train.x.shape[1:]} and test images {test.x.shape[1:]} differ in shape")
    return DatasetSplits(train, test, num_classes=10, input_shape=tuple(int(d) for d in train.x.shape[1:]))
