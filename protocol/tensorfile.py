"""Named numpy arrays in safetensors files, through the ``safetensors`` package, written atomically.

What this adds to the package: the write goes through :func:`~fedpar.protocol.atomicfile.atomic_path` (a crash
leaves the old file or the new one); the arrays come back in the order they were saved (the format sorts
tensors by dtype and name, so the order is kept in the metadata; files without it, such as those fedpar wrote
before it used the package, come back in data-offset order); only wire dtypes are accepted; and every failure
to read is a :class:`~fedpar.protocol.codec.CodecError` that names the file.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Sequence

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from fedpar.protocol.atomicfile import atomic_path
from fedpar.protocol.codec import CodecError, ModelLayout, as_wire_array

ORDER_KEY = "fedpar.order"  # metadata entry: the JSON list of tensor names in the order they were saved


def save_tensors(path: str | Path, names: Sequence[str], arrays: Sequence[np.ndarray],
                 metadata: dict[str, str] | None = None) -> None:
    """Atomically write named arrays (and string metadata) to a safetensors file."""
    arrays = [as_wire_array(a) for a in arrays]  # contiguous little-endian: the package writes raw buffers
    ModelLayout.of_arrays(names, arrays)  # names unique and non-empty, dtypes the wire's
    metadata = {**(metadata or {}), ORDER_KEY: json.dumps(list(names))}
    with atomic_path(path) as tmp:
        mode = stat.S_IMODE(tmp.stat().st_mode)  # the umask's, as every other output has
        try:
            save_file(dict(zip(names, arrays)), tmp, metadata)
            os.chmod(tmp, mode)  # the package leaves its file readable by its owner only
        except SafetensorError as exc:
            # The package says why a write failed in its message only ("I/O error: No space left on device (os
            # error 28) at path ..."): an OSError of that errno, so that the caller can say what to do.
            found = re.search(r"\(os error (\d+)\)", str(exc))
            if found is None:
                raise
            code = int(found.group(1))
            raise OSError(code, os.strerror(code), str(path)) from exc


def load_tensors(path: str | Path) -> tuple[list[str], list[np.ndarray], dict[str, str]]:
    """Read a safetensors file; returns names, arrays (in the order saved) and metadata (without the order)."""
    path = Path(path)
    try:
        with safe_open(path, framework="np") as fh:
            metadata = dict(fh.metadata() or {})
            names = _order(path, metadata.pop(ORDER_KEY, None), fh.offset_keys())
            arrays = [fh.get_tensor(name) for name in names]
    except FileNotFoundError:  # the package's says which file only in its message
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path)) from None
    except SafetensorError as exc:
        raise CodecError(f"{path}: not a safetensors file, or a truncated or damaged one ({exc})") from None
    except (TypeError, ValueError, KeyError) as exc:  # e.g. a dtype numpy cannot hold
        raise CodecError(f"{path}: cannot be read as numpy arrays ({exc})") from None
    try:
        ModelLayout.of_arrays(names, arrays)
    except CodecError as exc:
        raise CodecError(f"{path}: {exc}") from None
    return names, arrays, metadata


def _order(path: Path, saved: str | None, in_file: list[str]) -> list[str]:
    """The tensor names in the order they were saved (``saved``, the metadata's list), else in file order."""
    if saved is None:
        return list(in_file)
    try:
        names = json.loads(saved)
    except json.JSONDecodeError:
        names = None
    if not isinstance(names, list) or sorted(names, key=str) != sorted(in_file):
        raise CodecError(f"{path}: its {ORDER_KEY!r} metadata does not list the file's tensors")
    return names
