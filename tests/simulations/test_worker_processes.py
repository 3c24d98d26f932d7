"""The simulation's worker processes start before the coordinator's process imports torch, and a run that stops
before it hands them their slices ends them."""

from __future__ import annotations

import subprocess
import sys
import time

from fedpar.simulations.worker_processes import WorkerProcesses


def test_starting_the_workers_imports_no_torch_here():
    # `fedpar simulate` starts them first so that their imports overlap its own: that needs this module to be light
    code = ("import sys; from fedpar.simulations.worker_processes import start_workers; "
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_workers_of_a_run_that_stopped_before_their_slices_are_ended_and_closing_again_does_nothing():
    # e.g. a setting refused after they started: the command ends them at once, while they still import
    workers = WorkerProcesses(2, None, None)
    assert all(p.is_alive() for p in workers.procs)
    workers.close(wait=False)
    end = time.monotonic() + 30
    while any(p.is_alive() for p in workers.procs) and time.monotonic() < end:
        time.sleep(0.05)
    assert not any(p.is_alive() for p in workers.procs)
    workers.close(wait=False)  # a second close (the command's, after the run's) has nothing left to do
