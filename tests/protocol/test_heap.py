"""trim_heap gives freed C-heap pages back to the OS (glibc), and is a no-op elsewhere; once a server froze its startup
heap, it also frees the garbage cycles a round left."""

import ctypes.util
import os
import re
import subprocess
import sys

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


def test_after_the_startup_heap_is_frozen_each_trim_frees_the_garbage_cycles_a_round_left():
    # In a process of its own: freezing is for the whole process, and a test run must not freeze its own objects.
    script = """
import gc, weakref
from fedpar.protocol.heap import freeze_startup_heap, trim_heap

class Node:
    pass

startup = [Node() for _ in range(1000)]
freeze_startup_heap()
frozen = gc.get_freeze_count()
gc.disable()  # only trim_heap collects from here on, as between two of a long-lived server's full collections
node = Node()
node.self, node.payload = node, bytearray(1 << 20)
alive = weakref.ref(node)
del node
assert alive() is not None  # a cycle: reference counting alone never frees it
trim_heap()
print(frozen, alive() is None)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    frozen, freed = out.stdout.split()
    assert int(frozen) >= 1000 and freed == "True"


def test_the_heap_trace_names_the_line_whose_allocations_grow_every_round(tmp_path):
    # FEDPAR_HEAP_TRACE: the first dump is the baseline, later ones say what grew since it (a list kept per round).
    script = """
from fedpar.protocol.heap import count_round, freeze_startup_heap, trim_heap

history = []
freeze_startup_heap()
for _ in range(30):
    history.append(bytearray(10_000))  # kept_every_round
    count_round()
    trim_heap()
"""
    trace, program = tmp_path / "trace.txt", tmp_path / "server.py"  # a file: the trace quotes its lines
    program.write_text(script)
    subprocess.run([sys.executable, str(program)], env={**os.environ, "FEDPAR_HEAP_TRACE": f"{trace}:10"},
                   capture_output=True, text=True, timeout=60, check=True)
    dumps = trace.read_text().split("== round ")[1:]
    assert [d.split()[0] for d in dumps] == ["20", "30"]  # round 10 was the baseline
    grown, site = re.search(r"\n *([-+0-9.]+) KiB[^\n]*\n(.*?)\n *[-+0-9.]+ KiB|$", dumps[-1], re.S).groups()
    assert float(grown) >= 190 and "kept_every_round" in site  # 20 rounds x 10,000 bytes: the largest growth


@pytest.mark.skipif(not ctypes.util.find_library("c") or not hasattr(ctypes.CDLL(ctypes.util.find_library("c")),
                                                                     "mallopt"), reason="needs glibc")
@pytest.mark.parametrize("server", [True, False])
def test_a_server_keeps_large_blocks_in_mappings_of_their_own_after_a_larger_one_was_freed(server):
    # glibc's default raises its mmap threshold to the size of a freed mapped block: later large blocks then come
    # from the heap (where they fragment). A server's heap policy keeps them mapped, returned whole when freed.
    script = f"""
import ctypes
from fedpar.protocol.heap import freeze_startup_heap

class MallInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(None)
libc.mallinfo.restype, libc.malloc.restype, libc.free.argtypes = MallInfo, ctypes.c_void_p, [ctypes.c_void_p]
if {server}:
    freeze_startup_heap()
libc.free(libc.malloc(4 << 20))
before = libc.mallinfo().hblks
blocks = [libc.malloc(256 << 10) for _ in range(200)]
print(libc.mallinfo().hblks - before)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60,
                         check=True)
    # A few may fit in free space the interpreter's start left in the heap (4 of 20 on the GPU box's Python 3.12)
    mapped = int(out.stdout)
    assert mapped >= 180 if server else mapped == 0


def test_the_native_trace_holds_only_what_its_window_of_rounds_allocated_and_kept(tmp_path):
    # FEDPAR_NATIVE_TRACE: memray records from round 5 to round 15; of what a round allocates it holds what was
    # still allocated at round 15: the blocks kept every round in that window, and the last round's scratch.
    memray = pytest.importorskip("memray")
    script = """
from fedpar.protocol.heap import count_round, freeze_startup_heap, trim_heap

history = []
freeze_startup_heap()
for _ in range(20):
    history.append(bytearray(100_000))  # kept every round
    scratch = bytearray(300_000)  # freed by the next round
    count_round()
    trim_heap()
"""
    record = tmp_path / "native.bin"
    subprocess.run([sys.executable, "-c", script], env={**os.environ, "FEDPAR_NATIVE_TRACE": f"{record}:5:15"},
                   capture_output=True, text=True, timeout=60, check=True)
    held = {r.size // r.n_allocations: r.n_allocations for r in
            memray.FileReader(record).get_leaked_allocation_records(merge_threads=True) if r.size >= 100_000}
    assert held == {100_001: 10, 300_001: 1}  # the 10 rounds' kept blocks; of the scratch ones only the last


def test_the_native_trace_without_memray_says_what_to_install():
    script = """
import sys
sys.modules["memray"] = None  # as if it were not installed
from fedpar.protocol.heap import freeze_startup_heap
freeze_startup_heap()
"""
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "FEDPAR_NATIVE_TRACE": "/tmp/x.bin:1:2"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stderr.strip() == ("FEDPAR_NATIVE_TRACE needs memray: pip install memray "
                                                          "(or unset the variable)")


def test_a_coordinator_counts_its_rounds_for_the_heap_trace_only_when_one_is_on(tmp_path):
    # The trace's counter is one of the coordinator's round-end callbacks, taken when it is built after
    # freeze_startup_heap (which starts the trace FEDPAR_HEAP_TRACE asks for); before that it has none, and a round
    # runs no code of the traces'.
    script = """
import numpy as np
from fedpar.aggregation.registry import build_strategy
from fedpar.protocol.heap import freeze_startup_heap
from fedpar.server.config import CoordinatorConfig
from fedpar.server.coordinator import Coordinator

def coordinator():
    return Coordinator(CoordinatorConfig(), ["w"], [np.zeros(4, np.float32)], build_strategy("fedavg"))

untraced = coordinator()
freeze_startup_heap()
traced = coordinator()
print(len(untraced.on_round_end), len(traced.on_round_end))
for _ in range(3):
    for callback in traced.on_round_end:  # as the end of each round calls them
        callback({})
"""
    trace = tmp_path / "trace.txt"
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "FEDPAR_HEAP_TRACE": f"{trace}:1"},
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["0", "1"]
    assert [d.split()[0] for d in trace.read_text().split("== round ")[1:]] == ["2", "3"]  # round 1: the baseline
