"""A coordinator that restarts under its clients: `kill -9` of a real `fedpar serve` (with --checkpoint-dir), twice,
each time restarted with the same command on the same port, while three client runtimes (client/runtime.py) stay
up: one hosting a population of members (`fedpar simulate-workers`) and two hosting one member each, themselves
(`fedpar client`). Each backs off while the coordinator is down and joins again (a new session for it and every
member) when the new one does not know it; all are sampled and their updates count after each restart, and no
process of the clients dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fedpar.ports import ReservedPort

ROOT = Path(__file__).resolve().parents[2]
MEMBERS, AGENTS = 4, 2  # the host's population, and the plain agents beside it
EVERYONE = MEMBERS + AGENTS
ROUNDS = 20  # enough that the kills land mid-run (each round takes a fraction of a second)
RETRY = ["--max-backoff", "0.5"]  # the clients look for the restarted coordinator often


def _start(tmp: Path, name: str, args: list[str]) -> subprocess.Popen:
    with open(tmp / f"{name}.log", "a") as log:  # a file, not a pipe: a full pipe would block the process
        return subprocess.Popen([sys.executable, "-m", "fedpar", *args], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _serve(tmp: Path, port: int) -> subprocess.Popen:
    """The same command every time: checkpoints in tmp/ckpt, outputs in tmp/out, on ``port``."""
    return _start(tmp, "serve", [
        "serve", "--insecure", "--port", str(port), "--port-file", str(tmp / "port"), "--checkpoint-dir",
        str(tmp / "ckpt"), "--out", str(tmp / "out"), "--accept-populations", "--no-central-eval",
        "--rounds", str(ROUNDS), "--min-available", str(EVERYONE), "--clients-per-round", str(EVERYONE),
        "--overselect", "1.0", "--deadline", "5", "--heartbeat", "1", "--liveness-timeout", "3",
        "--local-epochs", "1", "--batch-size", "32"])


def _rows(tmp: Path) -> list[dict]:
    path = tmp / "out" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(what: str, predicate, clients: list[subprocess.Popen], tmp: Path, timeout: float = 90) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` (with the logs) if a client exits or time runs out."""
    end = time.monotonic() + timeout
    while not predicate():
        dead = [p.args[3] for p in clients if p.poll() is not None]
        assert not dead, f"{dead} exited while waiting for {what}:\n" + _logs(tmp)
        assert time.monotonic() < end, f"timed out waiting for {what}:\n" + _logs(tmp)
        time.sleep(0.02)


def _logs(tmp: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("*.log")))


def test_a_population_host_and_agents_outlive_two_coordinator_restarts(tmp_path):
    reserved = ReservedPort()  # the coordinator's port at its three starts: no other process takes it in between
    port = reserved.port
    server = _serve(tmp_path, port)
    clients: list[subprocess.Popen] = []
    restarts = []  # the last round checkpointed before each kill
    try:
        address = f"127.0.0.1:{port}"
        clients.append(_start(tmp_path, "host", ["simulate-workers", "--server", address, "--insecure",
                                                 "--clients", str(MEMBERS), "--seats", "2", *RETRY]))
        clients += [_start(tmp_path, f"agent{a}", ["client", "--server", address, "--agent-id", f"agent-{a}",
                                                   "--insecure", "--num-partitions", str(AGENTS), "--partition-index",
                                                   str(a), "--poll", "2", *RETRY]) for a in range(AGENTS)]
        for _ in range(2):
            done = len(_rows(tmp_path))
            _wait_for(f"two rounds after round {done}", lambda: len(_rows(tmp_path)) >= done + 2, clients, tmp_path)
            assert server.poll() is None
            os.kill(server.pid, signal.SIGKILL)
            server.wait(10)
            restarts.append(len(_rows(tmp_path)))
            (tmp_path / "port").unlink()
            time.sleep(0.5)  # the clients find it gone: their calls fail UNAVAILABLE, and they back off
            assert all(p.poll() is None for p in clients), _logs(tmp_path)
            server = _serve(tmp_path, port)  # the same command, port and checkpoint directory
        assert server.wait(120) == 0, _logs(tmp_path)
        for p in clients:  # told that training is over: every client leaves by itself
            assert p.wait(60) == 0, _logs(tmp_path)
    finally:
        for p in (server, *clients):
            if p.poll() is None:
                p.kill()
        reserved.close()
    rows = _rows(tmp_path)
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))  # every round once, across the restarts
    serve_log = (tmp_path / "serve.log").read_text()
    # a kill between a round's checkpoint and its metrics line resumes after that round (the line is repaired)
    assert all(any(f"resumed from checkpoint after round {n}" in serve_log for n in (r, r + 1)) for r in restarts), \
        (restarts, serve_log[-3000:])
    for start, end in zip(restarts, restarts[1:] + [ROUNDS]):
        after = rows[start:end]  # the rounds the restarted coordinator ran
        assert after and all(r["status"] == "ok" and r["sampled"] == EVERYONE for r in after), after
        # the host's members took part again: more updates counted than the plain agents could send
        assert max(r["reported"] for r in after) == EVERYONE, after
    host_log = (tmp_path / "host.log").read_text()
    assert "Traceback" not in host_log and "UNAUTHENTICATED" not in host_log, host_log
    assert f"{MEMBERS} clients hosted" in host_log, host_log
