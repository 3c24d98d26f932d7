"""`fedpar serve --state` stopped (SIGINT, SIGTERM) while an operator follows a run with `fedpar run logs ID -f`:
the follow ends in one line saying the service stopped (exit 1), and the service writes no traceback of a closed
state file. Real processes, real gRPC over mutual TLS on 127.0.0.1 (ports 0)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedpar.cli.main import main
from support.processes import stop_processes

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _wait_for(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_follow_under_way_when_the_service_stops_ends_in_one_line_and_the_service_in_no_traceback(tmp_path, sig):
    certs = tmp_path / "certs"
    assert main(["certs", "--out", str(certs), "--operators", "op"]) == 0
    serve_log = tmp_path / "serve.log"
    with open(serve_log, "w") as log:
        serve = subprocess.Popen([sys.executable, "-m", "fedpar.cli.main", "serve", "--state",
                                  str(tmp_path / "state.db"), "--certs", str(certs), "--host", "127.0.0.1",
                                  "--port", "0", "--control-port", "0", "--control-port-file",
                                  str(tmp_path / "cport")], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=ENV)
    follow = None
    try:
        _wait_for(lambda: (tmp_path / "cport").exists() or serve.poll() is not None, 60, "the control port")
        assert serve.poll() is None, serve_log.read_text()
        options = ["--control", f"127.0.0.1:{int((tmp_path / 'cport').read_text())}", "--certs", str(certs),
                   "--operator", "op"]
        run_file = tmp_path / "run.toml"
        run_file.write_text("rounds = 2\n")
        submitted = subprocess.run([sys.executable, "-m", "fedpar.cli.main", "run", "submit", str(run_file),
                                    *options], cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=120)
        assert submitted.returncode == 0 and submitted.stdout.strip() == "1", submitted  # no agent: it waits
        follow = subprocess.Popen([sys.executable, "-m", "fedpar.cli.main", "run", "logs", "1", "-f", *options],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        first = follow.stdout.readline()  # the follow is under way: it polls the state file
        assert first.startswith("run 1 (run) started") or "waits" in first, first
        time.sleep(0.5)
        serve.send_signal(sig)
        assert serve.wait(timeout=60) == 0
        out, err = follow.communicate(timeout=60)
    finally:
        stop_processes(serve)
        if follow is not None and follow.poll() is None:
            stop_processes(follow)
    said = serve_log.read_text()
    assert "Traceback" not in said and "closed database" not in said, said
    assert f"fedpar service: stopped by {sig.name}" in said, said
    assert follow.returncode == 1, (out, err)
    assert err.splitlines() == [f"fedpar run: the service at {options[1]} stopped (a run it was executing resumes "
                                "when it starts again on the same --state); follow the run again then"], err
