"""A Ctrl-C that comes while a launcher starts its ranks is held back, not lost (parallel/stopping.py interrupts_held):
in a fresh interpreter, where multiprocessing's resource tracker is not running yet."""

from __future__ import annotations

import subprocess
import sys

# SIGINT comes while a rank starts; another thread runs (a launcher's store, say), which the kernel hands the signal
# to while the main thread blocks it
HELD_START = """
import multiprocessing as mp, os, signal, threading, time
from fedpar.parallel.stopping import interrupts_held

if __name__ == "__main__":
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
    try:
        with interrupts_held("spawn") as release:
            os.kill(os.getpid(), signal.SIGINT)
            rank = mp.get_context("spawn").Process(target=os.getpid)
            rank.start()
            time.sleep(0.2)  # the signal is in, whichever thread took it
            release()
        print("lost")
    except KeyboardInterrupt:
        print("held, then raised")
    rank.join()
"""


def test_a_ctrl_c_while_spawned_ranks_start_is_held_then_raised():
    # it was dropped, the launcher going on as if none had come: ignored while the ranks started (so that they were
    # born ignoring it), it went to the other thread; and the first spawned process started multiprocessing's
    # resource tracker, which unblocked SIGINT on the main thread too
    done = subprocess.run([sys.executable, "-c", HELD_START], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "held, then raised", (done.stdout, done.stderr)
