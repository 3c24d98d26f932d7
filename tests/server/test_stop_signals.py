"""One signal to the main PID stops a whole coordinator: SIGINT or SIGTERM to `fedpar serve` or `fedpar simulate`,
with one aggregator rank or two, ends every process of its tree within seconds, after the summary, the final model
and the last checkpoint are written, and exits 130 or 143, as a supervisor (systemd, Docker, a script) that signals
only the main PID expects. A second signal exits at once, and the checkpoint directory still loads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fedpar.wording import counted
from fedpar.server.checkpoint import load_checkpoint
from fedpar.server.final_model import load_final_model
from support.devices import RANKS_ON_CPU
from support.digit_agents import start_digit_agents
from support.in_process import main_here
from support.processes import port_in_file

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--local-epochs", "1", "--batch-size", "32", "--rounds", "100000"]  # rounds run until the signal
STOP_SECONDS = 8.0  # "within a few seconds" of the signal: 2-3 s on 2 quiet cores, 5.06 s once in CI at load 4-12


def _start(tmp: Path, args: list[str]) -> subprocess.Popen:
    with open(tmp / "run.log", "a") as log:  # a file, not a pipe: a full pipe would block the process
        return subprocess.Popen([sys.executable, "-m", "fedpar", *args], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _serve(tmp: Path, ranks: int) -> subprocess.Popen:
    return _start(tmp, ["serve", "--insecure", "--port", "0", "--port-file", str(tmp / "port"), "--checkpoint-dir",
                        str(tmp / "ckpt"), "--out", str(tmp / "out"), "--no-central-eval", "--aggregator-ranks",
                        str(ranks), "--min-available", "2", "--clients-per-round", "2", "--overselect", "1.0",
                        "--heartbeat", "1", *(("--aggregator-timeout", "30") if ranks > 1 else ()), *RANKS_ON_CPU,
                        *QUICK])


def _simulate(tmp: Path, ranks: int) -> subprocess.Popen:
    return _start(tmp, ["simulate", "--clients", "2", "--workers", "1", "--aggregator-ranks", str(ranks), "--out",
                        str(tmp / "out"), "--quiet", *QUICK])


def _port(tmp: Path, proc: subprocess.Popen) -> int:
    """The port ``proc`` (a `fedpar serve`) listens on, once it does."""
    return port_in_file(tmp / "port", proc, tmp / "run.log", 120)


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # gone meanwhile
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie has ended)."""
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _rounds_done(tmp: Path) -> int:
    path = tmp / "out" / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _running(tmp: Path, proc: subprocess.Popen, ranks: int, rounds: int = 2) -> set[int]:
    """Wait until ``rounds`` rounds completed; the processes below ``proc`` then (every rank among them)."""
    end = time.monotonic() + 120
    while _rounds_done(tmp) < rounds:
        assert proc.poll() is None, (tmp / "run.log").read_text()
        assert time.monotonic() < end, (tmp / "run.log").read_text()
        time.sleep(0.05)
    tree = _descendants(proc.pid)
    assert len(tree) >= ranks - 1, tree
    return tree


def _stop(tmp: Path, proc: subprocess.Popen, tree: set[int], *signals: int) -> tuple[int, float]:
    """Send ``signals`` to the main PID, one after the other; its exit code and the seconds until the whole
    tree was gone."""
    started = time.monotonic()
    for i, signum in enumerate(signals):
        if i:
            time.sleep(0.02)  # while it stops (the launcher's handler has taken the first)
        proc.send_signal(signum)
    try:
        code = proc.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running 30 s after {signals}:\n{(tmp / 'run.log').read_text()[-3000:]}")
    while _alive(tree) and time.monotonic() - started < 30:
        time.sleep(0.02)
    assert not _alive(tree), f"left running: {_alive(tree)}"
    return code, time.monotonic() - started


@pytest.fixture
def agents():
    """Real agents (threads of this process) against a coordinator; stopped after the test."""
    started = []

    def start(port: int):
        torch.set_num_threads(1)
        made, _, errors = start_digit_agents(port, ["a0", "a1"], give_up_after=30)
        started.extend(made)
        return errors
    yield start
    for agent in started:
        agent.stop()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_one_signal_to_a_two_rank_serve_stops_every_rank_and_writes_the_summary_and_checkpoint(tmp_path, agents,
                                                                                              signum):
    proc = _serve(tmp_path, 2)
    try:
        agents(_port(tmp_path, proc))
        tree = _running(tmp_path, proc, ranks=2)
        code, seconds = _stop(tmp_path, proc, tree, signum)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "run.log").read_text()
    assert code == 128 + signum, log[-3000:]
    assert seconds < STOP_SECONDS, seconds
    assert "Traceback" not in log, log[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["interrupted"] and summary["rounds"] == _rounds_done(tmp_path) >= 2
    assert log.count(f"fedpar serve: interrupted after {counted(summary['rounds'], 'completed round')}") == 1, log[-3000:]
    ckpt = load_checkpoint(tmp_path / "ckpt")  # the last completed round's (its metrics line may not be logged)
    assert ckpt.round_id in (summary["rounds"], summary["rounds"] + 1)
    kept = json.loads((tmp_path / "out" / "global.json").read_text())
    assert kept["interrupted"] and kept["round"] >= summary["rounds"]
    names, arrays = load_final_model(tmp_path / "out")
    assert names == ckpt.names and len(arrays) == len(ckpt.arrays)


def test_a_second_signal_ends_a_stopping_serve_at_once_and_the_checkpoint_still_loads(tmp_path, agents):
    proc = _serve(tmp_path, 2)
    try:
        agents(_port(tmp_path, proc))
        tree = _running(tmp_path, proc, ranks=2)
        code, seconds = _stop(tmp_path, proc, tree, signal.SIGTERM, signal.SIGINT)
    finally:
        if proc.poll() is None:
            proc.kill()
    # the second signal's (130): the launcher killed its ranks and left. On a loaded machine both may be pending
    # when Python runs its handlers, which it does in signal-number order: SIGINT is then the first, SIGTERM the
    # second (143; CI at 9db6649)
    assert code in (130, 143)
    assert seconds < 2.0, seconds
    assert load_checkpoint(tmp_path / "ckpt").round_id >= 2  # LATEST names a complete checkpoint, whenever it died


def test_the_same_signal_twice_at_once_is_one_request_to_stop_cleanly(tmp_path):
    # `timeout -s INT` and `kill -INT -PGID` reach the main PID twice (by its id and by its group) within
    # milliseconds: that is not the "now" of a second Ctrl-C, and the summary and model must still be written
    proc = _simulate(tmp_path, 1)
    try:
        tree = _running(tmp_path, proc, ranks=1)
        code, seconds = _stop(tmp_path, proc, tree, signal.SIGINT, signal.SIGINT)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "run.log").read_text()
    assert code == 130, log[-3000:]
    assert seconds < STOP_SECONDS, seconds
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["interrupted"] and "Traceback" not in log, log[-3000:]
    assert json.loads((tmp_path / "out" / "global.json").read_text())["round"] >= summary["rounds"]


@pytest.mark.parametrize("command, ranks", [("serve", 1), ("simulate", 1), ("simulate", 2)])
def test_sigterm_stops_serve_and_simulate_with_exit_143_and_a_summary(tmp_path, agents, command, ranks):
    proc = _serve(tmp_path, ranks) if command == "serve" else _simulate(tmp_path, ranks)
    try:
        if command == "serve":
            agents(_port(tmp_path, proc))
        tree = _running(tmp_path, proc, ranks)
        code, seconds = _stop(tmp_path, proc, tree, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "run.log").read_text()
    assert code == 143, log[-3000:]
    assert seconds < STOP_SECONDS, seconds
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["interrupted"] and summary["rounds"] >= 2
    assert "Traceback" not in log and f"fedpar {command}: interrupted after {counted(summary['rounds'], 'completed round')}" in log, \
        log[-3000:]
    assert json.loads((tmp_path / "out" / "global.json").read_text())["round"] >= summary["rounds"]


def test_the_ranks_leave_when_their_launcher_is_killed(tmp_path, agents):
    proc = _serve(tmp_path, 2)
    try:
        agents(_port(tmp_path, proc))
        tree = _running(tmp_path, proc, ranks=2)
        code, seconds = _stop(tmp_path, proc, tree, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == -signal.SIGKILL
    assert seconds < STOP_SECONDS, seconds  # rank 0 stopped as on SIGTERM (the kernel's word that its parent died)
    assert load_checkpoint(tmp_path / "ckpt").round_id >= 2


def test_a_rank_that_raised_is_named_with_the_exception_it_ended_on():
    from torch.multiprocessing.spawn import ProcessRaisedException

    from fedpar.cli.serve import _rank_failure

    trace = ("\n\n-- Process 1 terminated with the following error:\nTraceback (most recent call last):\n"
             '  File "x.py", line 1, in f\n    g()\nRuntimeError: CUDA error: invalid device ordinal\n')
    said = _rank_failure(ProcessRaisedException(trace, 1, 42))
    assert said == "aggregator rank 1 failed: RuntimeError: CUDA error: invalid device ordinal"
    missing = trace.replace("RuntimeError: CUDA error: invalid device ordinal", "RankMissing: rank 0 is gone")
    assert _rank_failure(ProcessRaisedException(missing, 1, 42)) == "an aggregator rank failed: rank 0 is gone"


def test_a_simulate_into_an_earlier_runs_out_keeps_it_on_a_refusal_and_on_a_stop_before_round_1(
        tmp_path):
    """A refused command loses nothing of the earlier run's outputs; nor does one stopped after its settings were
    checked (its set-up began, before round 1), which writes nothing of its own beside them."""
    out = tmp_path / "out"
    out.mkdir()
    earlier = ("metrics.jsonl", "metrics.csv", "global.safetensors", "global.json", "summary.json")
    for name in earlier:
        (out / name).write_text("of an earlier run\n")
    # the refusal in this process (a refusal line and the files, not a process's signal handling)
    refused = main_here("simulate", "--clients", "4", "--rounds", "50", "--out", str(out), "--strategy-option",
                        "bogus=1")
    assert refused.returncode == 2, refused
    assert sorted(p.name for p in out.iterdir()) == sorted(earlier), refused
    proc = _start(tmp_path, ["simulate", "--clients", "4", "--rounds", "50", "--out", str(out)])
    end = time.monotonic() + 120
    while "loading digits" not in (tmp_path / "run.log").read_text():  # its settings are checked: set-up begins
        assert proc.poll() is None and time.monotonic() < end, (tmp_path / "run.log").read_text()
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130, (tmp_path / "run.log").read_text()
    assert sorted(p.name for p in out.iterdir()) == sorted(earlier), (tmp_path / "run.log").read_text()
    assert all((out / name).read_text() == "of an earlier run\n" for name in earlier)


def test_serve_on_two_ranks_stopped_as_its_ranks_start_says_so_in_one_line(tmp_path):
    """A Ctrl-C while rank 0 built its coordinator ended serve with exit 130 and not a word (QA: 5 runs of 5 at
    1.1-1.15 s): rank 0 took the launcher's stop before its run could say what completed."""
    proc = _start(tmp_path, ["serve", "--insecure", "--port", "0", "--aggregator-ranks", "2", "--rounds", "3",
                             "--out", str(tmp_path / "out"), *RANKS_ON_CPU])
    end = time.monotonic() + 120
    while not _descendants(proc.pid):  # rank 0 started: it builds its model and joins the group
        assert proc.poll() is None and time.monotonic() < end, (tmp_path / "run.log").read_text()
        time.sleep(0.01)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130, (tmp_path / "run.log").read_text()
    said = [line for line in (tmp_path / "run.log").read_text().splitlines() if "interrupted" in line]
    assert len(said) == 1 and said[0].startswith("fedpar serve: interrupted"), (tmp_path / "run.log").read_text()
    assert "Traceback" not in (tmp_path / "run.log").read_text()


def test_a_serve_into_an_earlier_runs_out_stopped_before_round_1_keeps_the_earlier_outputs(tmp_path):
    """Its metrics rows were appended to the earlier run's (as simulate's were: simulations/run_outputs.py); then it
    cleared them for a summary of no round; now they stay as they were, and it writes nothing of its own."""
    out = tmp_path / "out"
    out.mkdir()
    earlier = ("metrics.jsonl", "metrics.csv", "global.safetensors", "global.json", "accuracy.png")
    for name in earlier:
        (out / name).write_text("of an earlier run\n")
    proc = _start(tmp_path, ["serve", "--insecure", "--port", "0", "--port-file", str(tmp_path / "port"), "--out",
                             str(out), "--no-central-eval", "--min-available", "2"])
    _port(tmp_path, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130, (tmp_path / "run.log").read_text()
    assert sorted(p.name for p in out.iterdir()) == sorted(earlier), (tmp_path / "run.log").read_text()
    assert all((out / name).read_text() == "of an earlier run\n" for name in earlier)
    assert f"wrote nothing to {out}" in (tmp_path / "run.log").read_text()
