"""Ranks started from multiprocessing's fork server (a launcher that may not fork: it has served gRPC, or runs other
threads) write where their launcher writes now, see its environment as it is now, and die with it: real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a fork server is Linux's here")

ROOT = Path(__file__).resolve().parents[2]
SERVED = ("import grpc; s = grpc.server(None, handlers=[]); s.add_insecure_port('127.0.0.1:0'); s.start(); "
          "s.stop(0).wait()\n")
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT / "tests")}  # a GPU would have them spawned


def test_a_fork_servers_ranks_write_to_the_launchers_streams_and_see_its_environment_as_they_are_now(tmp_path):
    later = tmp_path / "later.txt"
    script = SERVED + f"""
import os, sys
from fedpar.parallel.init import rank_start_method, spawn
from support.launched import say_where
method = rank_start_method()
print(method, flush=True)
spawn(1, say_where, start_method=method)  # the fork server starts now, with this process's streams of now
fd = os.open({str(later)!r}, os.O_WRONLY | os.O_CREAT)
os.dup2(fd, 1)
os.dup2(fd, 2)
os.environ["MARK"] = "set-later"
spawn(1, say_where, start_method=method)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["forkserver", "rank 0 sees MARK=None"]
    assert later.read_text().splitlines() == ["rank 0 sees MARK=set-later", "rank 0 on stderr"]


def test_a_fork_servers_rank_dies_with_its_launcher(tmp_path):
    pid_file = tmp_path / "rank.pid"
    script = SERVED + f"""
from fedpar.parallel.init import rank_start_method, spawn
from support.launched import wait_long
method = rank_start_method()
assert method == "forkserver", method
spawn(1, wait_long, {str(pid_file)!r}, parent_stops=True, start_method=method)
"""
    launcher = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=ENV, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 60
        while not pid_file.exists() and launcher.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        assert pid_file.exists(), launcher.stderr.read() if launcher.poll() is not None else "no rank in 60 s"
        rank = int(pid_file.read_text())
        launcher.kill()  # kill -9: nothing of the launcher's runs to stop the rank
        launcher.wait()
        end = time.monotonic() + 20
        while _runs(rank) and time.monotonic() < end:
            time.sleep(0.05)
        assert not _runs(rank), "the rank outlived its launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


@pytest.mark.parametrize("preload", ["fedpar's", "without its exit"])
def test_a_fork_server_leaves_without_the_interpreters_teardown_once_its_launcher_is_gone(tmp_path, preload):
    """The fork server skips tearing torch and the rest down (0.4-0.5 s of CPU): the exit handler of a module it
    preloaded first never runs. Without parallel/fork_server_exit.py among its preloads it does, so the check holds."""
    marker = tmp_path / "torn-down"
    script = SERVED + f"""
from multiprocessing import forkserver
import fedpar.parallel.init as init
from support.launched import say_where
preload = [m for m in init.FORK_SERVER_PRELOAD if {preload == "fedpar's"} or not m.endswith("fork_server_exit")]
init.FORK_SERVER_PRELOAD = ("support.torn_down", *preload)
method = init.rank_start_method()
assert method == "forkserver", method
init.spawn(1, say_where, start_method=method)
print(forkserver._forkserver._forkserver_pid, flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**ENV, "FEDPAR_TEST_TORN_DOWN": str(marker)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    server = int(done.stdout.split()[-1])
    end = time.monotonic() + 30
    while _runs(server) and time.monotonic() < end:  # the server sees its launcher gone and leaves
        time.sleep(0.05)
    assert not _runs(server), "the fork server outlived its launcher"
    assert marker.exists() == (preload != "fedpar's")


def _runs(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_process_forked_from_one_with_a_fork_server_starts_its_own_ranks():
    """A simulation in a process forked from one that had started ranks from a fork server (a test process's, or any
    launcher's that runs one command after another) failed to start its aggregator ranks with "No child processes":
    multiprocessing's copy of the parent's fork server in the child checks on it with waitpid. Such a child now
    starts its ranks by spawn."""
    script = """
import multiprocessing as mp, os, sys
from fedpar.parallel.init import rank_start_method
from fedpar.parallel.stopping import interrupts_held

def started(method):
    with interrupts_held(method):  # as the ranks start (server/ranks/local.py)
        rank = mp.get_context(method).Process(target=os.getpid)
        rank.start()
    rank.join()
    return rank.exitcode

method = rank_start_method(may_fork=False)
mp.get_context("forkserver").set_forkserver_preload([])  # the server's imports are not what is tested: no torch
print(method, started(method), flush=True)  # the fork server starts

def forked():
    method = rank_start_method(may_fork=False)
    print("forked:", method, started(method), flush=True)

child = mp.get_context("fork").Process(target=forked)
child.start()
child.join()
sys.exit(child.exitcode)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["forkserver 0", "forked: spawn 0"]
