"""`fedpar client --give-up-after N` against a coordinator that is not there gives up about N seconds after its first
failed dial (its last wait is cut to the time left, not a whole backoff step past N) and says how long it waited."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import grpc
import pytest

from fedpar.client.links import FatalAgentError, Reconnecting
from support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
GIVE_UP = 3.0



def test_fedpar_client_gives_up_at_give_up_after_and_says_the_time_it_waited():
    port = free_port()
    agent = subprocess.Popen([sys.executable, "-m", "fedpar", "client", "--server", f"127.0.0.1:{port}", "--insecure",
                              "--agent-id", "a", "--give-up-after", str(GIVE_UP), "--threads", "1", "--device", "cpu"],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines, ended = [], None
    with agent:
        for line in agent.stderr:  # the time of its last line as it comes, not of its exit: a loaded machine's
            lines.append(line.rstrip("\n"))  # teardown (2 s under a suite of four workers) is not the wait
            ended = time.time()
        assert agent.wait(timeout=60) == 1, lines
    assert lines and "Traceback" not in "\n".join(lines), lines
    said = re.fullmatch(rf"fedpar client: a: coordinator at 127\.0\.0\.1:{port} unreachable for ([0-9.]+)s; is it "
                        r"running, and does its TLS setting \(--certs/--insecure\) match this agent's\?", lines[-1])
    assert said, lines[-1]
    retries = [line for line in lines if "coordinator unreachable (UNAVAILABLE); retrying in" in line]
    first = datetime.strptime(retries[0][:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # the first failed dial
    waited = ended - first  # up to its last line
    assert GIVE_UP <= waited < GIVE_UP + 1.5, (waited, lines)  # before: up to a whole step (5 s) past it
    assert GIVE_UP <= float(said.group(1)) <= min(waited + 0.05, GIVE_UP + 0.5), (said.group(1), waited)
    assert sum(float(line.rsplit(" ", 1)[1].rstrip("s")) for line in retries) <= GIVE_UP + 0.1, retries


class Longest:
    """Jitter's longest factor: each wait 1.5 times its step."""

    def random(self) -> float:
        """Just under 1."""
        return 0.999


def test_the_last_wait_is_cut_to_the_time_left_and_the_line_says_the_time_waited():
    address = f"127.0.0.1:{free_port()}"
    channel = grpc.insecure_channel(address)
    ping = channel.unary_unary("/fedpar.Probe/Ping")
    calls = Reconnecting("a", address, join=lambda: None, first=0.4, cap=5.0, rng=Longest(),
                         give_up_after=1.0)
    started = time.monotonic()
    with pytest.raises(FatalAgentError) as refused:
        calls.call(lambda: ping(b"", timeout=1.0))
    seconds = time.monotonic() - started
    channel.close()
    assert 1.0 <= seconds < 1.6, seconds  # waits of 0.6 and 1.2 s before: it gave up at 1.8 s
    waited = float(re.search(r"unreachable for ([0-9.]+)s", str(refused.value)).group(1))
    assert 1.0 <= waited <= seconds + 0.05, (waited, seconds)
