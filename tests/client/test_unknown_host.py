"""`fedpar client --server HOST:PORT` with a host name that cannot be looked up says so at once, naming --server, as
`fedpar run --control` does (one line, security/handshake.py lookup_trouble), instead of retrying and saying
'unreachable ... is it running'; a name that resolves keeps retrying. Names under .invalid never resolve (RFC 6761).
Where no DNS server answers (a machine without one, or an outage) the agent retries, saying so in each retry's line
and in its last."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from fedpar.security.handshake import lookup_trouble
from support.in_process import run_main


def _resolver_answers() -> bool:
    """Whether this machine's resolver says that a name under .invalid is unknown (the GPU box has no DNS server:
    every lookup fails for now there)."""
    try:
        socket.getaddrinfo("coordinator.invalid", 1)
    except socket.gaierror as exc:
        return exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME))
    return False


needs_dns = pytest.mark.skipif(not _resolver_answers(), reason="no DNS server answers here")


@needs_dns
def test_a_server_name_that_cannot_be_looked_up_is_one_line_naming_server_at_once(tmp_path, capfd):
    started = time.monotonic()
    done = run_main(["client", "--insecure", "--server", "coordinator.invalid:50051", "--agent-id", "a",
                     "--give-up-after", "60", "--threads", "1", "--device", "cpu"], capfd, tmp_path)
    took = time.monotonic() - started
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "Traceback" not in done.stderr and "unreachable" not in done.stderr, done
    assert lines[-1] == ("fedpar client: a: the host name of coordinator.invalid:50051 cannot be looked up (mistyped? "
                         "a name no DNS server knows); check --server"), lines
    assert took < 20, took  # not the whole retry budget


@needs_dns
def test_lookup_trouble_asks_the_resolver_unless_grpc_said_resolving_failed():
    line = "the host name of {} cannot be looked up (mistyped? a name no DNS server knows); check --server"
    for address in ("coordinator.invalid:7000", f"{'a' * 64}.example:7000", "bad host:7000"):
        assert lookup_trouble(address, "--server") == (line.format(address), True), address
    for address in ("127.0.0.1:7000", "localhost:7000", "[::1]:7000", "no port"):
        assert lookup_trouble(address, "--server") is None, address
    assert lookup_trouble("127.0.0.1:7000", "--server", "DNS resolution failed for x") == (
        line.format("127.0.0.1:7000"), True)


def _without_network() -> list[str]:
    """A command prefix running it in a network namespace of its own, with no route to any DNS server (root and
    unshare needed), or [] where that cannot be made here."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return []
    try:
        subprocess.run(["unshare", "-n", "true"], check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return ["unshare", "-n"]


def test_where_no_dns_server_answers_the_agent_retries_saying_so_and_its_last_line_names_it(tmp_path):
    prefix = _without_network()
    if not prefix:
        pytest.skip("needs a network namespace of its own (root, unshare -n)")
    done = subprocess.run([*prefix, sys.executable, "-m", "fedpar", "client", "--insecure", "--server",
                           "coordinator.invalid:50051", "--agent-id", "a", "--give-up-after", "3", "--threads", "1",
                           "--device", "cpu"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    why = "the host name of coordinator.invalid:50051 cannot be looked up now ("
    advice = "): no DNS server answered; check this machine's DNS, or give --server an IP address"
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    retries = [line for line in lines if "coordinator unreachable (UNAVAILABLE): " + why in line]
    assert retries and all(advice + "; retrying in" in line for line in retries), lines
    assert lines[-1].startswith("fedpar client: a: coordinator at coordinator.invalid:50051 unreachable for ") and \
        lines[-1].endswith(advice) and why in lines[-1], lines
