"""`fedpar run` pointed where no service's control API is: a web server (a service's --metrics-port), another
program's port (SSH, a database) or a TLS port that speaks no gRPC (a service's --data-port) is named as such, in one
line that says which port to give, not as a TLS handshake that failed or in gRPC's words. Real sockets on 127.0.0.1
(port 0), the command's main run in this process."""

from __future__ import annotations

import contextlib
import http.server
import re
import socket
import ssl
import threading

import pytest

from fedpar.security.certs import ensure_certs
from support.in_process import run_main


class _Quiet(http.server.BaseHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - its signature; the requests' lines are not the command's
        pass


@pytest.fixture()
def web_server():
    """An HTTP/1 server on a loopback port (as a service's --metrics-port is): its address."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_run_at_a_web_server_says_it_is_one_and_which_port_to_give(web_server, tmp_path, capfd):
    # it said 'TLS handshake with the service at ... failed: WRONG_VERSION_NUMBER; check --certs DIR and the
    # service's TLS options': the certificates were right, the port was not
    certs = tmp_path / "certs"
    ensure_certs(certs, operators=["op"])
    done = run_main(["run", "ls", "--control", web_server, "--certs", str(certs), "--operator", "op"], capfd)
    assert done.returncode == 1 and done.stdout == "", done
    # gRPC's own log lines, which a process of its own would not show (main sets GRPC_VERBOSITY before gRPC loads)
    said = [line for line in done.stderr.splitlines() if not re.match(r"[IWE]\d{4} \d\d:\d\d:\d\d", line)]
    assert "Traceback" not in done.stderr and said == [
        f"fedpar run: {web_server} answers in HTTP/1, not gRPC: it is a web server (a service's --metrics-port?), "
        "not a service's control API; give --control the service's --control-port"], done.stderr


@contextlib.contextmanager
def _answering(answer):
    """A loopback port whose every connection ``answer(conn)`` serves on a thread of its own: its address."""
    server = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def accept():
        server.settimeout(0.2)
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn, contextlib.suppress(OSError):
                answer(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        done.set()
        thread.join(10)
        server.close()


@pytest.fixture()
def other_program():
    """A loopback port where a program that speaks neither TLS nor gRPC answers (an SSH server's banner): its
    address."""
    def banner(conn):
        conn.sendall(b"SSH-2.0-OpenSSH_8.9\r\n")
        conn.settimeout(2)
        conn.recv(4096)  # until the client hangs up

    with _answering(banner) as address:
        yield address


def test_run_at_another_programs_port_says_so_not_that_the_certificates_are_wrong(other_program, tmp_path, capfd):
    # it said 'TLS handshake with the service at ... failed: WRONG_VERSION_NUMBER; check --certs DIR and the
    # service's TLS options'
    certs = tmp_path / "certs"
    ensure_certs(certs, operators=["op"])
    done = run_main(["run", "ls", "--control", other_program, "--certs", str(certs), "--operator", "op"], capfd)
    said = [line for line in done.stderr.splitlines() if not re.match(r"[IWE]\d{4} \d\d:\d\d:\d\d", line)]
    assert done.returncode == 1 and done.stdout == "", done
    assert "Traceback" not in done.stderr and said == [
        f"fedpar run: {other_program} answers in neither TLS nor gRPC (another program's port?): it is not a "
        "service's control API; give --control the service's --control-port"], done.stderr


@pytest.fixture()
def tls_not_grpc(tmp_path):
    """A loopback port that speaks TLS with the service's own certificate but not gRPC (no HTTP/2 in its handshake),
    as a coordinator's --data-port does: its address and the certificates' folder."""
    certs = tmp_path / "certs"
    ensure_certs(certs, operators=["op"])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs / "server.pem", certs / "server.key")
    context.load_verify_locations(certs / "ca.pem")
    context.verify_mode = ssl.CERT_OPTIONAL

    def frame(conn):
        with context.wrap_socket(conn, server_side=True) as tls:
            tls.settimeout(2)
            tls.recv(4096)
            tls.sendall(b"\x00\x01")  # a frame of its own protocol, then it hangs up

    with _answering(frame) as address:
        yield address, certs


def test_run_at_a_tls_port_that_is_not_grpc_says_so(tls_not_grpc, capfd):
    # it said gRPC's 'failed to connect to all addresses; last error: UNKNOWN: ipv4:...: Cannot check peer: missing
    # selected ALPN property. at ...; is 'fedpar serve --state' running there?'
    address, certs = tls_not_grpc
    done = run_main(["run", "ls", "--control", address, "--certs", str(certs), "--operator", "op"], capfd)
    said = [line for line in done.stderr.splitlines() if not re.match(r"[IWE]\d{4} \d\d:\d\d:\d\d", line)]
    assert done.returncode == 1 and done.stdout == "", done
    assert "Traceback" not in done.stderr and said == [
        f"fedpar run: {address} speaks TLS but not gRPC (a service's --data-port?): it is not a service's control "
        "API; give --control the service's --control-port"], done.stderr
