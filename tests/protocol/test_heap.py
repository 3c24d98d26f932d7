"""trim_heap gives freed C-heap pages back to the OS (glibc), and is a no-op elsewhere."""

import ctypes.util
import os

import numpy as np
import pytest

from fedpar.protocol.heap import trim_heap


def _rss_kib() -> int:
    with open(f"/proc/{os.getpid()}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status") or not ctypes.util.find_library("c"),
                    reason="needs Linux /proc and a C library")
def test_freed_small_blocks_leave_the_process_after_a_trim():
    # Many small arrays (below glibc's mmap threshold) come from the heap; freeing all but every 64th leaves
    # the heap's pages free but resident until trimmed.
    blocks = [np.ones(16_000, np.uint8) for _ in range(20_000)]  # about 320 MB in 16 KB blocks
    kept = blocks[::64]
    del blocks
    before = _rss_kib()
    released = trim_heap()
    after = _rss_kib()
    assert released, "glibc's malloc_trim released nothing"
    assert after < before - 100_000, (before, after)  # over 100 MB handed back
    assert all(int(a[0]) == 1 for a in kept)  # what is still in use is untouched
