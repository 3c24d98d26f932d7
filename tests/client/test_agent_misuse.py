"""`fedpar client` used wrongly, as a new user would: --server pointing at a web server (a coordinator's
--metrics-port), and TLS flags half given. Each ends in one line saying what to change, with its exit code and no
traceback; none is retried for ever."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

import pytest

from fedpar.security.certs import ensure_certs

from support.in_process import run_main


@pytest.fixture()
def web_server():
    """An HTTP/1 server on a loopback port: its address."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _said(err: str) -> list[str]:
    """The lines `fedpar client` said as its own (not its log's)."""
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("fedpar client:")]


def test_a_web_server_at_server_is_named_at_once_not_retried_for_ever(web_server, tmp_path):
    """It was 'coordinator unreachable (UNAVAILABLE)', retried without end (with --certs, or --insecure)."""
    ensure_certs(tmp_path / "certs", ["alice"])
    for tls in (["--insecure"], ["--certs", str(tmp_path / "certs")]):
        done = subprocess.run([sys.executable, "-m", "fedpar", "client", "--server", web_server, "--agent-id", "alice",
                               "--threads", "1", *tls], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 1, done.stderr
        assert "retrying" not in done.stderr, done.stderr
        assert _said(done.stderr) == [
            f"fedpar client: alice: {web_server} answers in HTTP/1, not gRPC: it is a web server (a coordinator's "
            "--metrics-port?), not a coordinator's agents' port; give --server the coordinator's --port"], done.stderr


def test_tls_flags_half_given_say_the_missing_half(tmp_path, capfd):
    """A certificate without its key was said as 'no CA certificate given' (the CA was not what was missing)."""
    certs = tmp_path / "certs"
    ensure_certs(certs, ["alice"])
    cert, key, ca = str(certs / "alice.pem"), str(certs / "alice.key"), str(certs / "ca.pem")
    cases = [(["--tls-cert", cert], f"--tls-cert {cert} needs its private key: add --tls-key KEY"),
             (["--tls-cert", cert, "--tls-ca", ca], f"--tls-cert {cert} needs its private key: add --tls-key KEY"),
             (["--tls-key", key], f"--tls-key {key} needs its certificate: add --tls-cert PEM"),
             (["--tls-cert", cert, "--tls-key", key],
              "no CA certificate given to check the coordinator with: add --tls-ca CA.pem (the ca.pem of the "
              "'fedpar certs' folder that issued the certificates), or pass --certs DIR")]
    for flags, says in cases:
        done = run_main(["client", "--server", "127.0.0.1:1", "--agent-id", "alice", "--give-up-after", "1",
                         "--threads", "1", *flags], capfd)
        assert done.returncode == 2, done.stderr
        assert _said(done.stderr) == [f"fedpar client: {says}"], done.stderr
