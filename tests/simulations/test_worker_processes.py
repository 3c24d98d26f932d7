"""The simulation's worker processes: forked from the command's process once it has imported what they run, where
it may fork (one thread, no GPU), else from multiprocessing's fork server (Linux); and a run that stops before it
hands them their slices ends them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from support.processes import children

from fedpar.simulations.worker_processes import WorkerProcesses, start_method

ROOT = Path(__file__).resolve().parents[2]
SERVER_APP = ["--flower-app", str(ROOT / "tests" / "flower" / "tiny_app"), "--run-config", "num-server-rounds=100000"]


@pytest.mark.parametrize("options", [
    ["--rounds", "300"],
    pytest.param(SERVER_APP, id="server-app",  # its ServerApp drives: they were spawned after its coordinator started
                 marks=pytest.mark.skipif(not importlib.util.find_spec("flwr"), reason="needs fedpar[flower]"))])
def test_a_simulate_commands_workers_are_forked_copies_of_it_that_import_nothing_again(tmp_path, options):
    cmd = [sys.executable, "-m", "fedpar", "simulate", "--clients", "4", *options, "--out", str(tmp_path / "out"),
           "--quiet"]
    # no GPU for it: a visible one has the workers spawned (CUDA does not survive a fork)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    try:
        end, workers = time.monotonic() + 60, []
        while len(workers) < 2 and proc.poll() is None and time.monotonic() < end:
            workers = children(proc.pid)
            time.sleep(0.05)
        assert len(workers) == 2, proc.stderr.read() if proc.poll() is not None else "no 2 workers in 60 s"
        mine = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        # a spawned worker runs `python -c 'from multiprocessing.spawn import ...'`; a forked one is this command
        assert [Path(f"/proc/{w}/cmdline").read_bytes() for w in workers] == [mine, mine]
    finally:
        proc.kill()
        proc.wait()


def test_workers_are_forked_from_a_process_of_one_thread_and_from_the_fork_server_beside_another_or_grpcs():
    code = "from fedpar.simulations.worker_processes import start_method; print(start_method())"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # a visible GPU would have them spawned (CUDA and forks)
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=env).stdout.strip() == "fork"
    # gRPC's core keeps a timer thread (no Python thread) once it has served: a forked copy would have none
    served = ("import grpc; s = grpc.server(None, handlers=[]); s.add_insecure_port('127.0.0.1:0'); s.start(); "
              "s.stop(0).wait(); " + code)
    assert subprocess.run([sys.executable, "-c", served], capture_output=True, text=True, check=True,
                          env=env).stdout.strip() == "forkserver"
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:  # the other thread might hold a lock the copy would need (a log's, gRPC's): a forked worker could hang
        # this process may see a GPU (a GPU box): then spawned too
        forks = sys.platform.startswith("linux") and not torch.cuda.is_available()
        assert start_method() == ("forkserver" if forks else "spawn")
    finally:
        stop.set()
        other.join()


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
