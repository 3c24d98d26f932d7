"""SIGHUP (a closed terminal, `kill -HUP`) stops a long-running command as SIGTERM does: what completed is written, one
line says so, exit 128 + 1 (a run service: its stop line, exit 0). It ended `fedpar serve`, `client`, `simulate` and
`train` at once by the default action, without a line. A SIGHUP ignored from birth (nohup) stays ignored. Real
processes, real gRPC over 127.0.0.1 (port 0)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fedpar.cli.main import main
from fedpar.parallel.stopping import StopRequested, stop_on_signals
from fedpar.wording import counted
from support.ports import free_port
from support.processes import stop_processes

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
HUP_CODE = 128 + signal.SIGHUP


def _start(tmp: Path, args: list[str], **popen) -> subprocess.Popen:
    with open(tmp / "run.log", "a") as log:  # a file, not a pipe: a full pipe would block the process
        return subprocess.Popen([sys.executable, "-m", "fedpar", *args], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env=ENV, **popen)


def _wait_for(proc: subprocess.Popen, tmp: Path, ready, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None and time.monotonic() < end, (tmp / "run.log").read_text()[-3000:]
        time.sleep(0.05)


def _ended(proc: subprocess.Popen, tmp: Path) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=60)
    finally:
        stop_processes(proc)
    return code, (tmp / "run.log").read_text()


def _rows(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_sighup_raises_the_stop_as_sigterm_does():
    outside = []  # the handler outside the block: it must not see the signal, and is back after the block

    def note(signum, frame):
        outside.append(signum)
    previous = signal.signal(signal.SIGHUP, note)
    try:
        with stop_on_signals() as received:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(2)
        raise AssertionError(f"SIGHUP did not stop the block (the handler outside it saw {outside})")
    except StopRequested as exc:
        assert exc.signum == signal.SIGHUP and received.signal == "SIGHUP" and received.exit_code() == HUP_CODE
        assert signal.getsignal(signal.SIGHUP) is note and not outside
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_closed_terminal_stops_a_two_rank_simulate_that_writes_what_completed(tmp_path):
    """The hangup reaches the terminal's whole process group: the launcher stops its ranks, which ignore it."""
    out = tmp_path / "out"
    proc = _start(tmp_path, ["simulate", "--clients", "2", "--workers", "1", "--aggregator-ranks", "2", "--out",
                             str(out), "--quiet", "--local-epochs", "1", "--batch-size", "32", "--rounds", "100000"],
                  start_new_session=True)
    _wait_for(proc, tmp_path, lambda: _rows(out) >= 2)
    os.killpg(proc.pid, signal.SIGHUP)
    code, log = _ended(proc, tmp_path)
    assert code == HUP_CODE, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["rounds"] >= 2
    assert log.count(f"fedpar simulate: interrupted after {counted(summary['rounds'], 'completed round')}") == 1, \
        log[-3000:]
    assert json.loads((out / "global.json").read_text())["round"] >= summary["rounds"]


def test_sighup_stops_a_one_run_serve_with_its_line(tmp_path):
    proc = _start(tmp_path, ["serve", "--insecure", "--port", "0", "--port-file", str(tmp_path / "port"), "--out",
                             str(tmp_path / "out"), "--no-central-eval", "--min-available", "2"])
    _wait_for(proc, tmp_path, (tmp_path / "port").exists)
    proc.send_signal(signal.SIGHUP)
    code, log = _ended(proc, tmp_path)
    assert code == HUP_CODE, log[-3000:]
    assert "Traceback" not in log and "fedpar serve: interrupted after 0 completed rounds" in log, log[-3000:]


def test_a_serve_started_under_nohup_keeps_running_on_sighup(tmp_path):
    proc = _start(tmp_path, ["serve", "--insecure", "--port", "0", "--port-file", str(tmp_path / "port"), "--out",
                             str(tmp_path / "out"), "--no-central-eval", "--min-available", "2"],
                  preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    _wait_for(proc, tmp_path, (tmp_path / "port").exists)
    proc.send_signal(signal.SIGHUP)
    time.sleep(1.5)
    assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
    proc.send_signal(signal.SIGTERM)
    code, log = _ended(proc, tmp_path)
    assert code == 128 + signal.SIGTERM and "fedpar serve: interrupted" in log, log[-3000:]


def test_sighup_stops_a_run_service_as_sigterm_does(tmp_path):
    certs = tmp_path / "certs"
    assert main(["certs", "--out", str(certs), "--operators", "op"]) == 0
    proc = _start(tmp_path, ["serve", "--state", str(tmp_path / "state.db"), "--certs", str(certs), "--host",
                             "127.0.0.1", "--port", "0", "--control-port", "0", "--control-port-file",
                             str(tmp_path / "cport")])
    _wait_for(proc, tmp_path, (tmp_path / "cport").exists)
    proc.send_signal(signal.SIGHUP)
    code, log = _ended(proc, tmp_path)
    assert code == 0 and "Traceback" not in log, log[-3000:]
    assert log.strip().splitlines()[-1] == "fedpar service: stopped by SIGHUP", log[-3000:]


def test_sighup_stops_a_client_with_its_last_line(tmp_path):
    proc = _start(tmp_path, ["client", "--server", f"127.0.0.1:{free_port()}", "--insecure", "--agent-id", "alice",
                             "--threads", "1", "--device", "cpu", "--max-backoff", "0.5"])
    _wait_for(proc, tmp_path, lambda: "coordinator unreachable" in (tmp_path / "run.log").read_text())
    proc.send_signal(signal.SIGHUP)
    code, log = _ended(proc, tmp_path)
    assert code == HUP_CODE and "Traceback" not in log, log[-3000:]
    assert log.strip().splitlines()[-1] == "fedpar client: interrupted after 0 tasks, 0 updates accepted, 0 refused"


def test_sighup_stops_train_which_writes_its_summary_and_model(tmp_path):
    out = tmp_path / "run"
    proc = _start(tmp_path, ["train", "--model", "mlp", "--dataset", "digits", "--max-steps", "100000",
                             "--log-every", "2", "--device", "cpu", "--no-plot", "--out", str(out)])
    _wait_for(proc, tmp_path, lambda: _rows(out) >= 1)
    proc.send_signal(signal.SIGHUP)
    code, log = _ended(proc, tmp_path)
    assert code == HUP_CODE and "Traceback" not in log, log[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    kept = json.loads((out / "global.json").read_text())
    assert summary["interrupted"] is True and kept["interrupted"] is True
    assert log.count(f"fedpar train: interrupted after {summary['steps']} steps; wrote {out}/metrics.jsonl") == 1, log


HELPERS = """
import os, sys
from pathlib import Path
from fedpar.parallel.stopping import interrupts_held

with interrupts_held("forkserver"):  # starts multiprocessing's resource tracker and fork server, as a launch does
    pass
me = str(os.getpid())
print(" ".join(p.name for p in Path("/proc").iterdir() if p.name.isdigit() and
               (p / "stat").read_text().rsplit(")", 1)[1].split()[1] == me), flush=True)
sys.stdin.read()
"""


def _state(pid: str) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_the_resource_tracker_and_fork_server_outlive_a_closed_terminals_sighup():
    """They ignore Ctrl-C, which reaches a terminal's whole process group; so does its SIGHUP, which ended them: the
    fork server's children's exits were then read as 255, and the tracker was started again with a warning."""
    proc = subprocess.Popen([sys.executable, "-c", HELPERS], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=ENV)
    try:
        helpers = proc.stdout.readline().split()
        assert len(helpers) == 2, helpers
        for pid in helpers:
            os.kill(int(pid), signal.SIGHUP)
        time.sleep(1.0)
        states = [_state(pid) for pid in helpers]
        assert "Z" not in states, states  # a zombie: ended by the signal
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
