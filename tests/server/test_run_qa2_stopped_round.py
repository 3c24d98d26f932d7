"""A run stopped with `fedpar run stop ID` while its rounds go on (a stop may come while a round closes) says the
round it stopped after as one value: its reason's round is the round `fedpar run ls` shows, the last of its rows,
and the round of the summary and model it left. A real `fedpar serve --state` process and two real `fedpar client`
agents on 127.0.0.1 (ports 0), fast rounds, runs stopped one after another at different points of a round. (The
reason was computed before the stop settled the round closing then; the window between that read and the stop is a
few turns of the event loop, which these stops do not hit at will: this test holds the values together, it does not
force the race.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from fedpar.security.certs import ensure_certs
from fedpar.server.run_store import RunStore
from support.in_process import main_here
from support.processes import stop_processes
from support.stopped_runs import assert_stopped_as_recorded

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
FAST = "rounds = 100000\nclients_per_round = 2\nmin_reports = 1\nlocal_epochs = 1\nbatch_size = 256\n"
STOPS = 4


def _wait_for(predicate, timeout: float, what) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, what() if callable(what) else what
        time.sleep(0.05)


def _fedpar(log: Path, *args: str) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "fedpar.cli.main", *args], cwd=ROOT, env=ENV, stdout=out,
                                stderr=subprocess.STDOUT)


def test_a_stopped_runs_reason_names_the_round_it_recorded_last(tmp_path):
    certs, state = tmp_path / "certs", tmp_path / "state.db"
    ensure_certs(certs, ["a1", "a2"], ["127.0.0.1"], operators=["op"])
    serve = _fedpar(tmp_path / "serve.log", "serve", "--state", str(state), "--certs", str(certs), "--port", "0",
                    "--control-port", "0", "--port-file", str(tmp_path / "port"), "--control-port-file",
                    str(tmp_path / "cport"), "--min-available", "2", "--heartbeat", "1")
    agents: list[subprocess.Popen] = []
    store = None
    try:
        _wait_for(lambda: (tmp_path / "cport").exists() or serve.poll() is not None, 60, "serve did not start")
        assert serve.poll() is None, (tmp_path / "serve.log").read_text()
        port = int((tmp_path / "port").read_text())
        agents = [_fedpar(tmp_path / f"a{i}.log", "client", "--server", f"127.0.0.1:{port}", "--certs", str(certs),
                          "--agent-id", f"a{i}", "--num-partitions", "8", "--partition-index", str(i), "--poll", "1",
                          "--threads", "1", "--max-backoff", "0.5") for i in (1, 2)]
        store = RunStore(state)
        options = ("--control", f"127.0.0.1:{int((tmp_path / 'cport').read_text())}", "--certs", str(certs),
                   "--operator", "op")
        (tmp_path / "fast.toml").write_text(FAST)
        for attempt in range(STOPS):
            done = main_here("run", "submit", str(tmp_path / "fast.toml"), *options)
            assert done.returncode == 0, done
            run_id = int(done.stdout)
            # stopped at a different point of a round each time: a round takes a fraction of a second
            _wait_for(lambda: store.get(run_id).round >= 2 + attempt, 90, lambda: (tmp_path / "serve.log").read_text())
            time.sleep(0.07 * attempt)
            assert main_here("run", "stop", str(run_id), *options).returncode == 0
            _wait_for(lambda: store.get(run_id).status == "stopped", 60, lambda: store.get(run_id))
            assert_stopped_as_recorded(store, run_id)
    finally:
        if store is not None:
            store.close()
        stop_processes(*agents, serve)
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log, log
