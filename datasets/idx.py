"""Reading IDX files (the MNIST distribution format), plain or gzip-compressed, with numpy only."""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

# The third magic byte names the element type; the values are big-endian on disk.
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class IdxFormatError(ValueError):
    """An IDX file whose header or payload is malformed."""


def parse_idx(data: bytes, source: str = "<bytes>") -> np.ndarray:
    """Decode the bytes of an IDX file into an array of the declared type and dimensions."""
    if len(data) < 4:
        raise IdxFormatError(f"{source}: {len(data)} bytes is too short for an IDX header (need at least 4)")
    if data[0] != 0 or data[1] != 0:
        raise IdxFormatError(f"{source}: bad magic number {data[:4].hex()}; an IDX file starts with two zero "
                             "bytes (is this really an IDX file, or a gzip file without a .gz name?)")
    type_code, ndim = data[2], data[3]
    if type_code not in IDX_DTYPES:
        raise IdxFormatError(f"{source}: unknown IDX element type 0x{type_code:02x}")
    if ndim == 0:
        raise IdxFormatError(f"{source}: IDX header declares zero dimensions")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise IdxFormatError(f"{source}: truncated header: {ndim} dimensions need {header} bytes, file has {len(data)}")
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = IDX_DTYPES[type_code]
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    payload = len(data) - header
    if payload != expected:
        raise IdxFormatError(f"{source}: payload is {payload} bytes but dims {dims} of {dtype} need {expected} "
                             "(the file is truncated or corrupted)")
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="))


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file from disk; names ending in .gz are decompressed first."""
    path = Path(path)
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:  # zlib.error: a damaged compressed stream
            raise IdxFormatError(f"{path}: not a valid gzip file ({exc}); download it again") from None
    return parse_idx(raw, str(path))
