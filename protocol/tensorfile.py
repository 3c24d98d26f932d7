"""Tensor files in the safetensors layout (8-byte header length, JSON header, raw data), written atomically.

Readable by the ``safetensors`` library, and read here without pickle and with every header checked.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Sequence

import numpy as np

from fedpar.protocol.atomicfile import atomic_write_bytes
from fedpar.protocol.codec import CodecError, ModelLayout, as_wire_array

_TO_ST = {"float16": "F16", "float32": "F32", "float64": "F64", "int8": "I8", "int16": "I16",
          "int32": "I32", "int64": "I64", "uint8": "U8", "bool": "BOOL"}
_FROM_ST = {v: k for k, v in _TO_ST.items()}
MAX_HEADER_BYTES = 100 << 20


def save_tensors(path: str | Path, names: Sequence[str], arrays: Sequence[np.ndarray],
                 metadata: dict[str, str] | None = None) -> None:
    """Atomically write named arrays (and string metadata) to a safetensors-layout file."""
    arrays = [as_wire_array(a) for a in arrays]
    layout = ModelLayout.of_arrays(names, arrays)
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    for meta in layout.tensors:
        header[meta.name] = {"dtype": _TO_ST[meta.dtype], "shape": list(meta.shape),
                             "data_offsets": [meta.offset, meta.offset + meta.nbytes]}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned, as safetensors does
    parts: list[bytes | memoryview] = [struct.pack("<Q", len(blob)), blob]
    parts += [memoryview(a.reshape(-1)).cast("B") for a in arrays if a.nbytes]
    atomic_write_bytes(path, parts)


def _int(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError("not an integer")
    return value


def load_tensors(path: str | Path) -> tuple[list[str], list[np.ndarray], dict[str, str]]:
    """Read a file written by :func:`save_tensors`; returns names, arrays (in file order) and metadata."""
    path = Path(path)
    with open(path, "rb") as fh:
        raw_len = fh.read(8)
        if len(raw_len) != 8:
            raise CodecError(f"{path}: too short to be a tensor file")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > min(MAX_HEADER_BYTES, os.fstat(fh.fileno()).st_size - 8):
            raise CodecError(f"{path}: header length {header_len} is implausibly large for this file (truncated?)")
        try:
            header = json.loads(fh.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CodecError(f"{path}: header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise CodecError(f"{path}: header must be a JSON object")
        metadata = header.pop("__metadata__", {}) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise CodecError(f"{path}: __metadata__ must map strings to strings")
        entries = []
        for name, entry in header.items():
            try:
                dtype = _FROM_ST[entry["dtype"]]
                begin, end = (_int(x) for x in entry["data_offsets"])
                shape = [_int(d) for d in entry["shape"]]
            except (KeyError, TypeError, ValueError):
                raise CodecError(f"{path}: bad header entry for {name!r}") from None
            entries.append((begin, end, name, dtype, shape))
        entries.sort()
        try:
            layout = ModelLayout((name, dtype, shape) for _, _, name, dtype, shape in entries)
        except CodecError as exc:
            raise CodecError(f"{path}: {exc}") from None
        for (begin, end, name, _, _), meta in zip(entries, layout.tensors):
            if (begin, end) != (meta.offset, meta.offset + meta.nbytes):
                raise CodecError(f"{path}: tensor {name!r} has inconsistent data_offsets")
        remaining = os.fstat(fh.fileno()).st_size - fh.tell()
        if remaining != layout.total_bytes:
            raise CodecError(f"{path}: expected {layout.total_bytes} data bytes, found {remaining} (truncated?)")
        data = fh.read()
    if len(data) != layout.total_bytes:
        raise CodecError(f"{path}: expected {layout.total_bytes} data bytes, found {len(data)} (truncated?)")
    arrays = [np.frombuffer(data, dtype=np.dtype(m.dtype).newbyteorder("<"), count=m.numel, offset=m.offset)
              .reshape(m.shape).copy() for m in layout.tensors]
    return [m.name for m in layout.tensors], arrays, metadata
