"""Giving a round's freed memory back to the operating system, for long-lived processes (the coordinator and its
aggregator ranks call :func:`trim_heap` after a round: the ranks after every one, the coordinator at most once a
second), and a switch to find what still grows (rounds are counted only when it is on: :func:`round_counters`).

``FEDPAR_HEAP_TRACE=FILE[:EVERY]`` in a server's environment (off by default; it slows rounds) starts tracemalloc
when the startup heap is frozen and, every EVERY rounds (500), appends to FILE (``.rankN`` added on ranks other
than 0) the allocation sites that grew most since the first dump, and the object types the collector sees whose
counts grew: the figures to read when benchmarks/soak.py reports a memory slope.

``FEDPAR_NATIVE_TRACE=FILE:FROM:TO`` (needs ``pip install memray``) records every allocation, C ones with their
native stacks, from the server's round FROM to round TO into FILE (``.rankN`` as above): what was allocated in
that window and is still held at its end is what grew (``memray stats FILE``: the window's peak; memray's
FileReader(FILE).get_leaked_allocation_records(): each such allocation site).
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import gc
import linecache
import os
import time
import tracemalloc
from typing import Callable

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
M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # mallopt parameters (malloc.h)
SERVER_ARENAS = 2  # glibc heaps a server's threads share
SERVER_MMAP_THRESHOLD = 128 * 1024  # blocks from this size get their own mapping, unmapped when freed


def _bound_malloc() -> None:
    """glibc's policy for a process that lives for weeks: few heaps, and large blocks always mapped on their own.

    By default every thread that allocates may get a heap of its own (up to 8 per core), and once a large block
    (a round's upload, a host's batch) is freed, glibc raises the size from which blocks get their own mapping to
    that block's size (up to 32 MiB): later rounds' large blocks then come from the heaps, between long-lived
    small ones, and the heaps' resident size creeps up round after round (benchmarks/soak.py measured the
    anonymous part of the coordinator's PSS growing about 6x faster without this). A variable set in the
    environment (MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_) is left as the operator set it.
    """
    if _libc is None or not hasattr(_libc, "mallopt"):
        return
    if "MALLOC_ARENA_MAX" not in os.environ:
        _libc.mallopt(M_ARENA_MAX, SERVER_ARENAS)
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        _libc.mallopt(M_MMAP_THRESHOLD, SERVER_MMAP_THRESHOLD)


class _HeapTrace:
    """What FEDPAR_HEAP_TRACE asks for: growth of allocation sites and object counts, dumped every N rounds."""

    def __init__(self, spec: str):
        path, _, every = spec.partition(":")
        rank = os.environ.get("RANK", "0")
        self.path = path if rank == "0" else f"{path}.rank{rank}"
        self.every, self.rounds = int(every or 500), 0
        self.first: tracemalloc.Snapshot | None = None
        self.first_types: collections.Counter | None = None
        tracemalloc.start(12)

    @staticmethod
    def _types() -> collections.Counter:
        return collections.Counter(type(o).__qualname__ for o in gc.get_objects())

    def round_done(self, row: dict | None = None) -> None:
        """Count a round; every ``every`` rounds, append the growth since the first dump to the file."""
        self.rounds += 1
        if self.rounds % self.every:
            return
        snap = tracemalloc.take_snapshot().filter_traces([  # not what the trace itself holds
            tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, linecache.__file__),
            tracemalloc.Filter(False, __file__, all_frames=True)])
        types = self._types()
        if self.first is None:
            self.first, self.first_types = snap, types
            return
        traced, _ = tracemalloc.get_traced_memory()
        lines = [f"== round {self.rounds} ({time.strftime('%H:%M:%S')}): traced {traced / 2**20:.2f} MiB, "
                 f"gc objects {sum(types.values())} (+{sum(types.values()) - sum(self.first_types.values())})"]
        for stat in snap.compare_to(self.first, "traceback")[:12]:
            if stat.size_diff <= 0:
                continue
            lines.append(f"{stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks")
            lines.extend("      " + line for line in stat.traceback.format(limit=6, most_recent_first=True))
        grown = sorted(((n - self.first_types.get(t, 0), t) for t, n in types.items()), reverse=True)[:15]
        lines.append("types grown: " + ", ".join(f"{t} {d:+d}" for d, t in grown if d > 0))
        with open(self.path, "a") as fh:
            fh.write("\n".join(lines) + "\n")


class _NativeTrace:
    """What FEDPAR_NATIVE_TRACE asks for: memray's record of every allocation between two rounds."""

    def __init__(self, spec: str):
        path, start, stop = spec.rsplit(":", 2)
        rank = os.environ.get("RANK", "0")
        self.path = path if rank == "0" else f"{path}.rank{rank}"
        self.start, self.stop, self.rounds = int(start), int(stop), 0
        try:
            import memray
        except ImportError:
            raise SystemExit("FEDPAR_NATIVE_TRACE needs memray: pip install memray (or unset the variable)") from None
        self.tracker = memray.Tracker(self.path, native_traces=True)

    def round_done(self, row: dict | None = None) -> None:
        """Count a round; start recording at round ``start``, stop (the file is then complete) at round ``stop``."""
        self.rounds += 1
        if self.rounds == self.start:
            self.tracker.__enter__()
        elif self.rounds == self.stop:
            self.tracker.__exit__(None, None, None)


_trace: _HeapTrace | None = None
_native: _NativeTrace | None = None


def freeze_startup_heap() -> None:
    """Call once a long-lived server process has started (modules, model and data loaded): what exists now leaves
    the garbage collector's view, and from now on :func:`trim_heap` also frees the reference cycles a round left.

    Reference cycles are freed only by the collector, and some come back every round (gRPC's aio server leaves
    one per call it looks a handler up for); until collected they hold what they reference, native memory
    included. Python runs full collections in proportion to its long-lived objects, and the hundreds of
    thousands that importing torch and gRPC makes put them thousands of rounds apart; with those frozen, a full
    collection looks only at what rounds made and takes milliseconds. Not for processes that run tests or
    notebooks: frozen objects that later form garbage cycles are never freed. It also sets glibc's allocation
    policy for a long-lived process (:func:`_bound_malloc`).
    """
    global _collect_each_round, _trace, _native
    _bound_malloc()
    gc.collect()
    gc.freeze()
    _collect_each_round = True
    if os.environ.get("FEDPAR_HEAP_TRACE") and _trace is None:
        _trace = _HeapTrace(os.environ["FEDPAR_HEAP_TRACE"])
    if os.environ.get("FEDPAR_NATIVE_TRACE") and _native is None:
        _native = _NativeTrace(os.environ["FEDPAR_NATIVE_TRACE"])


def trim_heap() -> bool:
    """Free a round's garbage cycles (after :func:`freeze_startup_heap`), then return the C heap's free pages to
    the OS; True when glibc did release some (False where there is no glibc).

    gRPC, protobuf and numpy free small blocks all over glibc's arenas; without a trim the freed pages of a
    process that runs for weeks stay resident and its size creeps up with its age.
    """
    if _collect_each_round:
        gc.collect()
    return bool(_libc.malloc_trim(0)) if _libc is not None else False


def round_counters() -> list[Callable[[dict | None], None]]:
    """What counts a finished round for the traces FEDPAR_HEAP_TRACE and FEDPAR_NATIVE_TRACE ask for (nothing
    without them, so a round runs no code of theirs): a coordinator takes them among its round-end callbacks when it
    is built, after :func:`freeze_startup_heap`. Every round is counted, since one trim may cover several (the
    coordinator trims at most once a second)."""
    return [trace.round_done for trace in (_trace, _native) if trace is not None]


def count_round() -> None:
    """Count a finished round for those traces (an aggregator rank's round, which has no callbacks)."""
    for count in round_counters():
        count()
