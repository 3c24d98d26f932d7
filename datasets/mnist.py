"""MNIST from a local folder: train.npz/test.npz (keys x, y) or the four original IDX files (plain or .gz).

The images stay uint8 and are decoded to float32 only for the examples a client or the evaluation reads: the first
process to load a folder writes them uncompressed to a cache (``$XDG_CACHE_HOME/fedpar``, else ``~/.cache/fedpar``,
keyed by the files' paths, sizes and times), and every process then maps that one read-only copy, which the
kernel shares among them. Where the cache cannot be written, and for small sets (under 4 MiB), each process keeps
its own uint8 copy.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np

from fedpar.datasets.arrays import ByteImages, DatasetSplits
from fedpar.datasets.catalog import register_dataset
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


# uint8 pixel -> standardised float32 (a lookup: one gather instead of a cast and three passes over the floats)
MNIST_TABLE = ((np.arange(256, dtype=np.float32) / np.float32(255.0) - np.float32(MNIST_MEAN))
               / np.float32(MNIST_STD)).astype(np.float32)


SHARE_FROM_BYTES = 1 << 22  # smaller image sets are kept in each process, not written to the cache


def cache_dir() -> Path:
    """Where decoded dataset files are kept: $XDG_CACHE_HOME/fedpar, else ~/.cache/fedpar."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fedpar"


def shared_images(source: Path, read: Callable[[], np.ndarray]) -> np.ndarray:
    """The images in file ``source`` (``read()`` reads them) as a read-only memory map of a cache file written once
    for it (its path, size and modification time name it), which every process that loads it maps; what ``read()``
    gives when the cache cannot be written or read, or for fewer than SHARE_FROM_BYTES."""
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    path = cache_dir() / f"images-{key}.npy"
    images = None
    try:
        if not path.is_file():
            images = read()
            if images.nbytes < SHARE_FROM_BYTES:
                return images
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
                np.save(f, np.ascontiguousarray(images))
            os.replace(f.name, path)  # whole or not at all, whoever writes it first
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return read() if images is None else images


def _check_pair(images: np.ndarray, labels: np.ndarray, source: str) -> None:
    if images.dtype != np.uint8 or images.ndim != 3:
        raise ValueError(f"{source}: images must be uint8 with shape (N, H, W), got {images.dtype} {images.shape}")
    if not images.shape[1] * images.shape[2]:  # else the model's refusal, in the words of its in_features
        raise ValueError(f"{source}: images of {images.shape[1]}x{images.shape[2]} pixels hold nothing; save the "
                         "images themselves, shape (N, 28, 28)")
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{source}: labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{source}: {images.shape[0]} images but {labels.shape[0]} labels")
    if not labels.size:  # an empty test set trained with no accuracy (simulate) or stopped train with a traceback
        raise ValueError(f"{source} holds no examples; train and test each need at least one image and label")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{source}: labels must be digits 0..9, found range [{labels.min()}, {labels.max()}]")


def _read_npz(path: Path, key: str) -> np.ndarray:
    if not zipfile.is_zipfile(path):  # else np.load takes it for a pickle and blames object arrays
        raise ValueError(f"{path} is not an .npz file (cut short, or another kind of file); replace it with a whole "
                         f"copy: {EXPECTED_FILES}")
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = {"x", "y"} - set(data.files)
            array = None if missing else data[key]
    except ValueError as exc:
        if "allow_pickle" in str(exc):
            raise ValueError(f"{path} stores object arrays, which need pickle and are refused; save x and y as "
                             "plain uint8/integer arrays (np.savez(path, x=images, y=labels))") from exc
        # e.g. a member cut short inside a whole archive: numpy's words alone did not name the file
        raise ValueError(f"{path}: array {key} cannot be read ({exc}); replace it with a whole copy") from None
    except Exception as exc:  # zipfile.BadZipFile, OSError, ...: all mean "not a readable npz"
        raise ValueError(f"{path}: cannot read as .npz ({exc})") from exc
    if missing:
        raise ValueError(f"{path}: missing arrays {sorted(missing)}; expected keys x (images) and y (labels)")
    if not isinstance(array, np.ndarray):  # a member that is no .npy: np.load hands back its raw bytes
        raise ValueError(f"{path}: {key} is not a NumPy array (the archive was not written by np.savez); save it "
                         "with np.savez(path, x=images, y=labels)")
    return array


def _find_idx(folder: Path, name: str) -> Path | None:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _load_split(folder: Path, split: str, use_npz: bool) -> ByteImages:
    if use_npz:
        path = folder / NPZ_FILES[split]
        labels = _read_npz(path, "y")
        images = shared_images(path, lambda: _read_npz(path, "x"))
        source = str(path)
    else:
        image_path, label_path = (_find_idx(folder, n) for n in IDX_FILES[split])
        assert image_path is not None and label_path is not None  # checked by check_mnist_folder
        images, labels = shared_images(image_path, lambda: read_idx(image_path)), read_idx(label_path)
        source = f"{image_path.name} + {label_path.name}"
    _check_pair(images, labels, source)
    if split == "train" and (labels == labels[0]).all():  # a model of one digit scores 1.0 on a test set of it
        raise ValueError(f"{source}: every training label is {labels[0]}; training needs examples of two digits or "
                         "more (a test set may hold one)")
    return ByteImages(images, labels.astype(np.int64), MNIST_TABLE)


def check_mnist_folder(data_dir: str | Path) -> bool:
    """True when ``data_dir`` holds MNIST as train.npz/test.npz, False when as the IDX files; ValueError saying which
    files are expected and where to get them when the folder or its files are missing (nothing is read)."""
    folder = Path(data_dir)
    if folder.is_file():
        raise ValueError(f"MNIST folder {folder} is a file; point it at the folder that holds it")
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
    """MNIST from ``data_dir`` as (N, 1, 28, 28) float32 standardised images, decoded as they are read; npz files
    win over IDX files (ValueError as :func:`check_mnist_folder` says when they are missing)."""
    folder = Path(data_dir)
    has_npz = check_mnist_folder(folder)
    train = _load_split(folder, "train", has_npz)
    test = _load_split(folder, "test", has_npz)
    if train.shape != test.shape:
        raise ValueError(f"train images {train.shape} and test images {test.shape} differ in shape")
    return DatasetSplits(train, test, num_classes=10, input_shape=tuple(int(d) for d in train.shape))


@register_dataset("mnist", help="a local folder: --data-dir, train's --data-path",
                  folder=f"{EXPECTED_FILES}; {WHERE_TO_GET}")
def mnist_dataset(name: str, data_dir: str | Path) -> DatasetSplits:
    """``--dataset mnist``: the folder ``data_dir``."""
    return load_mnist(data_dir)
