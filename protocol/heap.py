"""Giving a round's freed memory back to the operating system, for long-lived processes (the coordinator and its
aggregator ranks call :func:`trim_heap` after every round)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

_libc = None
try:
    _name = ctypes.util.find_library("c")
    if _name:
        _candidate = ctypes.CDLL(_name)
        if hasattr(_candidate, "malloc_trim"):  # glibc only (not musl, not macOS)
            _libc = _candidate
except OSError:
    pass

_collect_each_round = False  # set by freeze_startup_heap: a long-lived server process's rounds collect cycles


def freeze_startup_heap() -> None:
    """Call once a long-lived server process has started (modules, model and data loaded): what exists now leaves
    the garbage collector's view, and from now on :func:`trim_heap` also frees the reference cycles a round left.

    Reference cycles are freed only by the collector, and some come back every round (gRPC's aio server leaves
    one per call it looks a handler up for); until collected they hold what they reference, native memory
    included. Python runs full collections in proportion to its long-lived objects, and the hundreds of
    thousands that importing torch and gRPC makes put them thousands of rounds apart; with those frozen, a full
    collection looks only at what rounds made and takes milliseconds. Not for processes that run tests or
    notebooks: frozen objects that later form garbage cycles are never freed.
    """
    global _collect_each_round
    gc.collect()
    gc.freeze()
    _collect_each_round = True


def trim_heap() -> bool:
    """Free a round's garbage cycles (after :func:`freeze_startup_heap`), then return the C heap's free pages to
    the OS; True when glibc did release some (False where there is no glibc).

    gRPC, protobuf and numpy free small blocks all over glibc's arenas; without a trim the freed pages of a
    process that runs for weeks stay resident and its size creeps up with its age.
    """
    if _collect_each_round:
        gc.collect()
    return bool(_libc.malloc_trim(0)) if _libc is not None else False
