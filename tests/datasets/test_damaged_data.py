"""A user's own data, damaged or odd (``--dataset mnist --data-dir DIR``, ``npz:PATH``, ``csv:PATH``): one line
saying what is wrong with which file and what to do, never a traceback from the loader's libraries."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from fedpar.datasets import load_dataset

from support.in_process import run_main

IDX_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _idx(array: np.ndarray) -> bytes:
    """``array`` (uint8) as an IDX file's bytes."""
    dims = b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return bytes([0, 0, 0x08, array.ndim]) + dims + array.tobytes()


def _mnist_idx_folder(folder, train: int = 40, test: int = 10):
    """A small MNIST folder of the four gzip-compressed IDX files."""
    rng = np.random.default_rng(0)
    folder.mkdir()
    for name, n in zip(IDX_NAMES, (train, train, test, test)):
        array = rng.integers(0, 256, (n, 28, 28)) if "images" in name else rng.integers(0, 10, n)
        (folder / f"{name}.gz").write_bytes(gzip.compress(_idx(array.astype(np.uint8))))
    return folder


def _refused(name: str, *says: str, **options) -> str:
    with pytest.raises(ValueError) as caught:
        load_dataset(name, **options)
    line = str(caught.value)
    assert "\n" not in line, line
    for words in says:
        assert words in line, line
    return line


def test_a_gzip_idx_file_with_a_damaged_stream_is_named(tmp_path):
    """zlib.error (not an OSError) escaped the loader: a traceback from simulate and train."""
    folder = _mnist_idx_folder(tmp_path / "mnist")
    path = folder / "train-images-idx3-ubyte.gz"
    data = path.read_bytes()
    path.write_bytes(data[:20] + bytes(200) + data[220:])
    _refused("mnist", f"{path}: not a valid gzip file", "download it again", data_dir=folder)


def test_a_compressed_npz_table_with_a_damaged_member_is_named(tmp_path):
    rng = np.random.default_rng(0)
    np.savez_compressed(tmp_path / "table.npz", x=rng.standard_normal((80, 3)), y=np.arange(80) % 3)
    data = bytearray((tmp_path / "table.npz").read_bytes())
    data[100:140] = bytes(40)
    (tmp_path / "table.npz").write_bytes(bytes(data))
    _refused(f"npz:{tmp_path / 'table.npz'}", "table.npz cannot be read as a NumPy .npz archive", "np.savez")
