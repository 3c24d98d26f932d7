"""Giving freed heap memory back to the operating system (glibc's ``malloc_trim``), for long-lived processes."""

from __future__ import annotations

import ctypes
import ctypes.util

_libc = None
try:
    _name = ctypes.util.find_library("c")
    if _name:
        _candidate = ctypes.CDLL(_name)
        if hasattr(_candidate, "malloc_trim"):  # glibc only (not musl, not macOS)
            _libc = _candidate
except OSError:
    pass


def trim_heap() -> bool:
    """Return the C heap's free pages to the OS; True when glibc did release some (False where there is no glibc).

    gRPC, protobuf and numpy free small blocks all over glibc's arenas; without a trim the freed pages of a
    process that runs for weeks stay resident and its size creeps up with its age.
    """
    return bool(_libc.malloc_trim(0)) if _libc is not None else False
