"""Per-update work (NaN/Inf scan, decoding, folding): on the event loop for small models, else on a worker thread."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

# Up to this many bytes the hand-off to a thread costs more than the work (a 100-agent round of a small
# model is 100 of these), so the work runs on the event loop.
INLINE_BYTES = 256 << 10


async def per_update(nbytes: int, fn, *args, executor: Executor | None = None):
    """``fn(*args)`` for one update of ``nbytes``: inline when small, else in ``executor`` (None: the loop's)."""
    if nbytes <= INLINE_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
