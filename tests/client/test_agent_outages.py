"""An agent whose coordinator is down says so once, then every few minutes, and says when it is back (it said a
line per retry, for ever: 18 lines in 72 s); SIGTERM stops an agent as Ctrl-C does, with the same last line (it
exited 143 without a word). Real `fedpar client` processes and real gRPC over loopback."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from fedpar.client.links import Reconnecting
from support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]



def _agent(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedpar", "client", "--server", f"127.0.0.1:{port}", "--insecure",
                             "--agent-id", "alice", "--threads", "1", "--device", "cpu", "--max-backoff", "0.5"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _lines_until(stream, words: str, timeout: float) -> list[str]:
    """Lines of ``stream`` up to the first holding ``words`` (read on a thread: a stuck agent fails the test)."""
    seen: list[str] = []
    found = threading.Event()

    def read():
        for line in stream:
            seen.append(line)
            if words in line:
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    assert found.wait(timeout), "".join(seen)
    return seen


def test_an_agent_says_a_coordinator_outage_once_and_sigterm_stops_it_as_ctrl_c_does():
    agent = _agent(free_port())
    try:
        first = _lines_until(agent.stderr, "coordinator unreachable", 120)[-1]
        time.sleep(4)  # retries every 0.25-0.75 s (--max-backoff 0.5): a line for each of 5 or more before
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=60)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    said = first.split("fedpar.client ", 1)[1]
    assert said.startswith("alice: coordinator unreachable (UNAVAILABLE); retrying in "), first
    assert first.rstrip().endswith("(said again when it answers, or every 5 min while it does not)"), first
    assert "coordinator unreachable" not in err and "still unreachable" not in err, err  # nothing more in 4 s
    # SIGTERM (systemd, Docker, kill) as Ctrl-C: the same last line (it exited 143 without a word), and 143
    assert agent.returncode == 143 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "fedpar client: interrupted after 0 tasks, 0 updates accepted, 0 refused"


class _Ping(grpc.GenericRpcHandler):
    def service(self, details):
        if details.method == "/fedpar.Probe/Ping":
            return grpc.unary_unary_rpc_method_handler(lambda request, context: b"pong")
        return None


def test_a_long_outage_is_said_again_every_remind_seconds_and_its_end_is_said(caplog):
    """Reconnecting (every call of an agent to its coordinator) with a 0.5 s reminder: a coordinator unreachable for
    about 1.75 s is said at once, again every half second or so, and once back, that it is back."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handler(_Ping()) if hasattr(server, "add_generic_rpc_handler") else \
        server.add_generic_rpc_handlers((_Ping(),))
    live = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    down = grpc.insecure_channel(f"127.0.0.1:{free_port()}")
    up = grpc.insecure_channel(live)
    back_at = time.monotonic() + 1.75

    def ping():  # the coordinator's address answers from back_at on (as a restarted one does)
        channel = down if time.monotonic() < back_at else up
        return channel.unary_unary("/fedpar.Probe/Ping")(b"", timeout=5)

    calls = Reconnecting("a", "127.0.0.1:PORT", join=lambda: None, first=0.05, cap=0.1, rng=_Half(), remind=0.5)
    try:
        with caplog.at_level(logging.DEBUG, logger="fedpar.client"):
            assert calls.call(ping) == b"pong"
            assert calls.call(ping) == b"pong"  # reachable: nothing said
    finally:
        down.close()
        up.close()
        server.stop(0)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    retries = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and "unreachable" in r.getMessage()]
    assert said[0].startswith("a: coordinator unreachable (UNAVAILABLE); retrying in 0.1s (said again when it "
                              "answers, or every 0.5 s while it does not)"), said
    reminders = said[1:-1]
    assert 1 <= len(reminders) <= 4 and all(r.startswith("a: coordinator still unreachable after ") and
                                            r.endswith("(UNAVAILABLE); retrying every 0.1s at most")
                                            for r in reminders), said
    assert said[-1].startswith("a: coordinator at 127.0.0.1:PORT reachable again after "), said
    assert len(retries) >= 5, retries  # each retry is still there at debug level


class _Half:
    """Jitter's middle: each wait is its step."""

    def random(self) -> float:
        return 0.5
