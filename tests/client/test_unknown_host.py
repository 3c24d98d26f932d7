"""`fedpar client --server HOST:PORT` with a host name that cannot be looked up says so at once, naming --server, as
`fedpar run --control` does (one line, security/handshake.py unknown_host), instead of retrying and saying
'unreachable ... is it running'; a name that resolves keeps retrying. Names under .invalid never resolve (RFC 6761)."""

from __future__ import annotations

import time

from fedpar.security.handshake import unknown_host
from support.in_process import run_main


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


def test_unknown_host_asks_the_resolver_unless_grpc_said_resolving_failed():
    line = "the host name of {} cannot be looked up (mistyped? a name no DNS server knows); check --server"
    for address in ("coordinator.invalid:7000", f"{'a' * 64}.example:7000", "bad host:7000"):
        assert unknown_host(address, "--server") == line.format(address), address
    for address in ("127.0.0.1:7000", "localhost:7000", "[::1]:7000", "no port"):
        assert unknown_host(address, "--server") is None, address
    assert unknown_host("127.0.0.1:7000", "--server", "DNS resolution failed for x") == line.format("127.0.0.1:7000")
