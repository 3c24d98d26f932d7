"""A run that needs more agents of its task than are joined (the service's --min-available, or the run's
min_reports above them) is still queued (agents may join later), but `fedpar run submit` and the run's log say at
once, in one line, how many it needs and how many are joined (so does `fedpar run ls`, as the queued run's
reason), and its wait in the run's log says for how many and why. A real
`fedpar serve --state` process and one real `fedpar client` agent on 127.0.0.1 (ports 0)."""

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

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TASK = "'mlp on digits'"


def _wait_for(predicate, timeout: float, what) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, what() if callable(what) else what
        time.sleep(0.1)


def _fedpar(log: Path, *args: str) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "fedpar.cli.main", *args], cwd=ROOT, env=ENV, stdout=out,
                                stderr=subprocess.STDOUT)


def _lines(store: RunStore, run_id: int) -> list[str]:
    return [entry for kind, _, entry in store.timeline(run_id) if kind == "line"]


def test_a_run_needing_more_agents_than_are_joined_is_queued_and_says_so_at_once(tmp_path):
    certs, state = tmp_path / "certs", tmp_path / "state.db"
    ensure_certs(certs, ["a1"], ["127.0.0.1"], operators=["op"])
    serve = _fedpar(tmp_path / "serve.log", "serve", "--state", str(state), "--certs", str(certs), "--port", "0",
                    "--control-port", "0", "--port-file", str(tmp_path / "port"), "--control-port-file",
                    str(tmp_path / "cport"), "--min-available", "2", "--heartbeat", "1")
    agent = None
    store = None
    try:
        _wait_for(lambda: (tmp_path / "cport").exists() or serve.poll() is not None, 60, "serve did not start")
        assert serve.poll() is None, (tmp_path / "serve.log").read_text()
        agent = _fedpar(tmp_path / "a1.log", "client", "--server", f"127.0.0.1:{int((tmp_path / 'port').read_text())}",
                        "--certs", str(certs), "--agent-id", "a1", "--poll", "1", "--threads", "1", "--max-backoff",
                        "0.5")
        _wait_for(lambda: " joined with " in (tmp_path / "serve.log").read_text(), 60,
                  lambda: (tmp_path / "serve.log").read_text())
        store = RunStore(state)
        options = ("--control", f"127.0.0.1:{int((tmp_path / 'cport').read_text())}", "--certs", str(certs),
                   "--operator", "op")

        def submit(name: str, text: str) -> tuple[int, str]:
            (tmp_path / f"{name}.toml").write_text(text)
            done = main_here("run", "submit", str(tmp_path / f"{name}.toml"), *options)
            assert done.returncode == 0 and done.stdout.strip().isdigit(), done  # queued: an agent may join later
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
            return int(done.stdout), lines[0]

        # before: both were queued without a word, the first to wait, the second to fail every round at its close
        many, said = submit("many", "rounds = 50\nclients_per_round = 3\nmin_reports = 3\nlocal_epochs = 1\n")
        need = (f"needs 3 agents with task {TASK} (min_reports = 3; its rounds fail with fewer) and 1 is joined now "
                "(a1)")
        assert said == f"fedpar run: warning: the run {need}", said
        assert store.get(many).reason == f"the run {need}"  # at once, as the queued run's reason ('fedpar run ls')
        two, said = submit("two", "rounds = 50\nclients_per_round = 2\nmin_reports = 1\nlocal_epochs = 1\n")
        need2 = (f"needs 2 agents with task {TASK} (the service's --min-available 2; it waits for them) and 1 is "
                 "joined now (a1)")
        assert said == f"fedpar run: warning: the run {need2}", said
        listed = main_here("run", "ls", *options)
        assert listed.returncode == 0 and f"(the run {need2})" in listed.stdout, listed
        # its wait says the same number, and why: the existing 'waits for' line, which said 2 (--min-available)
        waits = (f"run {many} waits for 3 agents with task {TASK} (min_reports = 3; its rounds fail with fewer): 1 "
                 "connected with it now (a1), 1 connected in all")
        _wait_for(lambda: waits in _lines(store, many), 60, lambda: _lines(store, many))
        for run_id in (many, two):
            assert main_here("run", "stop", str(run_id), *options).returncode == 0
        _wait_for(lambda: store.get(many).status == "stopped", 30, lambda: store.get(many))
        assert store.get(two).status == "stopped"
    finally:
        if store is not None:
            store.close()
        stop_processes(*([agent] if agent else []), serve)
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log, log
