"""A TLS handshake that fails is fatal for `fedpar client`, with the real cause in one line (issue 17): the
coordinator's certificate signed by another CA, issued for another name, or our certificate refused (foreign CA,
or none at all: an agent made for enrollment tokens); a revoked agent is refused by name (an expired certificate of
its own the agent says before dialling: test_certificate_kinds.py). Each is a real
`fedpar client` against a real coordinator. A TLS setting that differs from the coordinator's (--insecure on one
side only) is retried, its flag named (issue 31)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from fedpar.security.admission import Admission, RevocationList, append_revocation
from fedpar.security.certs import ensure_certs
from fedpar.security.handshake import diagnose_handshake, speaks_tls, tls_mismatch
from fedpar.security.tls import client_tls_files, server_credentials, server_tls_files


def _agent_folder(root: Path, name: str, ca_from: Path, cert_from: Path, agent_id: str = "alice") -> Path:
    """A --certs folder holding ``ca_from``'s ca.pem and ``cert_from``'s certificate and key of ``agent_id``."""
    folder = root / name
    folder.mkdir()
    shutil.copy(ca_from / "ca.pem", folder / "ca.pem")
    for suffix in (".pem", ".key"):
        shutil.copy(cert_from / f"{agent_id}{suffix}", folder / f"{agent_id}{suffix}")
    return folder


@pytest.fixture(scope="module")
def tls_world(tmp_path_factory, request):
    """The coordinator's CA (agents alice, bob; bob revoked), a foreign CA (its own alice), and agent folders that
    mix them; a mutual-TLS coordinator of the first CA on a loopback port."""
    from fedpar.aggregation import build_strategy
    from fedpar.server.app import CoordinatorServer
    from fedpar.server.config import CoordinatorConfig
    from fedpar.server.coordinator import Coordinator

    root = tmp_path_factory.mktemp("tls")
    ours, foreign = root / "ours", root / "foreign"
    ensure_certs(ours, ["alice", "bob"])
    ensure_certs(foreign, ["alice"])
    append_revocation(ours / "revoked.txt", agent_id="bob")
    admission = Admission(revocations=RevocationList(ours / "revoked.txt"), require_certificate=True)
    coordinator = Coordinator(CoordinatorConfig(rounds=1, min_available=5), ["w"], [np.zeros(3, np.float32)],
                              build_strategy("fedavg"), admission=admission)
    server = CoordinatorServer(coordinator, credentials=server_credentials(server_tls_files(ours)))
    server.start()
    request.addfinalizer(lambda: server.stop(grace=0.1))
    return SimpleNamespace(
        root=root, ours=ours, address=server.address,
        wrong_ca=_agent_folder(root, "wrong-ca", foreign, ours),
        foreign_cert=_agent_folder(root, "foreign-cert", ours, foreign))


def test_each_handshake_failure_ends_the_client_with_its_cause_in_one_line(tls_world, capsys, monkeypatch):
    w = tls_world
    cases = {  # name: (client options, the line's text)
        "unknown CA": (["--certs", str(w.wrong_ca), "--agent-id", "alice"],
                       f"its certificate is not signed by the CA in {w.wrong_ca / 'ca.pem'}"),
        "name mismatch": (["--certs", str(w.ours), "--agent-id", "alice", "--tls-server-name", "fl.example.org"],
                          "its certificate is not valid for the name 'fl.example.org' this agent dialled (it is "
                          "valid for localhost, 127.0.0.1)"),
        "foreign certificate": (["--certs", str(w.foreign_cert), "--agent-id", "alice"],
                                f"the coordinator refused this agent's certificate {w.foreign_cert / 'alice.pem'}: "
                                f"it was not issued by the CA in {w.foreign_cert / 'ca.pem'} but by another CA of "
                                "the same name"),
        "revoked": (["--certs", str(w.ours), "--agent-id", "bob"],
                    "coordinator refused: PERMISSION_DENIED: agent 'bob' was revoked"),
        "no certificate": (["--tls-ca", str(w.ours / "ca.pem"), "--agent-id", "dave"],
                           "the coordinator requires a client certificate (mutual TLS) and this agent has none"),
    }
    # One real `fedpar` process (its exit included); the others run `fedpar client` in this process, one by one.
    first, *rest = cases
    proc = subprocess.Popen([sys.executable, "-m", "fedpar", "client", "--server", w.address, "--give-up-after", "30",
                             "--threads", "1", *cases[first][0]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=w.root)
    results = {}
    for name in rest:
        results[name] = _client_in_process(capsys, monkeypatch, w.root, w.address, cases[name][0])
    results[first] = (proc.wait(120), proc.communicate()[1])
    for name, (code, err) in results.items():
        assert code == 1, (name, err)
        assert "Traceback" not in err and "retrying" not in err, (name, err)
        lines = [line for line in err.splitlines() if line.startswith("fedpar client:")]
        assert len(lines) == 1 and cases[name][1] in lines[0], (name, err)


def _client_in_process(capsys, monkeypatch, cwd: Path, address: str, options: list[str]) -> tuple[int, str]:
    """`fedpar client` run by :func:`fedpar.cli.main.main` here: its exit code and stderr."""
    import torch

    from fedpar.cli.main import main

    monkeypatch.chdir(cwd)
    capsys.readouterr()
    threads = torch.get_num_threads()
    try:
        code = main(["client", "--server", address, "--give-up-after", "30", "--threads", "1", *options])
    finally:
        torch.set_num_threads(threads)  # --threads is the process's setting: the tests after this one keep theirs
    return code, capsys.readouterr().err


def test_a_working_handshake_or_a_closed_port_is_no_tls_problem(tls_world):
    files = client_tls_files("alice", tls_world.ours)
    assert diagnose_handshake(tls_world.address, files) is None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{probe.getsockname()[1]}"  # bound, never listening: connection refused
        assert diagnose_handshake(closed, files) is None


def test_a_port_is_asked_whether_it_speaks_tls(coordinator_factory, tls_world):
    plaintext = coordinator_factory(None, min_available=5)
    assert speaks_tls(tls_world.address) is True
    assert speaks_tls(plaintext.address) is False
    assert tls_mismatch(tls_world.address, insecure=False) is None
    assert tls_mismatch(plaintext.address, insecure=True) is None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{probe.getsockname()[1]}"
        assert speaks_tls(closed) is None and tls_mismatch(closed, insecure=True) is None


def test_a_tls_mismatch_is_retried_and_its_first_retry_line_says_which_flag(coordinator_factory, tls_world):
    """A real `fedpar serve --certs` with a real `fedpar client --insecure`, and a real `fedpar client --certs` with a
    plaintext coordinator: each client retries (as for a coordinator that is down, which its operator may restart
    with the other setting), names the mismatch and the flag from its first retry line on, and neither side shows
    gRPC's own "Handshake failed" lines."""
    w = tls_world
    port_file = w.root / "mismatch.port"
    serve = subprocess.Popen([sys.executable, "-m", "fedpar", "serve", "--certs", str(w.ours), "--port", "0",
                              "--port-file", str(port_file), "--out", str(w.root / "mismatch-run"), "--rounds", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=w.root)
    plaintext = coordinator_factory(None, min_available=5)
    try:
        tls_client = _client_process(w.root, plaintext.address, ["--certs", str(w.ours), "--agent-id", "alice"])
        deadline = time.monotonic() + 60
        while not port_file.exists() and serve.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert port_file.exists(), serve.communicate()[1][-2000:]
        tls_address = f"127.0.0.1:{port_file.read_text().strip()}"
        insecure_client = _client_process(w.root, tls_address, ["--insecure", "--agent-id", "alice"])
        results = {"insecure agent, TLS coordinator": (insecure_client, "it seems to require TLS: drop --insecure and "
                                                                         "pass --certs DIR"),
                   "TLS agent, plaintext coordinator": (tls_client, "it seems not to speak TLS (started with "
                                                                    "--insecure?): pass --insecure to this agent")}
        for name, (client, says) in results.items():
            err = client.communicate(timeout=60)[1]
            code = client.returncode
            retries = [line for line in err.splitlines() if "retrying in" in line]
            assert code == 1 and len(retries) >= 2, (name, err)  # it kept trying until --give-up-after
            assert "coordinator unreachable (UNAVAILABLE): " + says in retries[0], (name, err)
            last = err.splitlines()[-1]
            assert last.startswith("fedpar client: alice: coordinator at ") and says in last, (name, err)
            assert "Handshake failed" not in err and "Traceback" not in err, (name, err)
    finally:
        serve.send_signal(signal.SIGINT)
        serve_err = serve.communicate(timeout=60)[1]
    assert "Handshake failed" not in serve_err, serve_err[-2000:]


def _client_process(cwd: Path, address: str, options: list[str]) -> subprocess.Popen:
    """A real `fedpar client` that gives up after 3 s without reaching the coordinator at ``address``."""
    return subprocess.Popen([sys.executable, "-m", "fedpar", "client", "--server", address, "--give-up-after", "3",
                             "--max-backoff", "1", "--threads", "1", *options], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd)


def test_fedpar_run_says_a_service_of_another_ca_in_the_agents_words_not_grpcs(tls_world):
    """`fedpar run` with --certs of another CA than the service's: one line saying so and what to do, as `fedpar
    client` says it (security/handshake.py for both), not gRPC's cut-off 'Tls handshake failed (TSI_...' text."""
    other = tls_world.root / "other-operators"
    ensure_certs(other, operators=["alice"])
    command = [sys.executable, "-m", "fedpar", "run", "ls", "--control", tls_world.address, "--certs", str(other),
               "--operator", "alice"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tls_world.root)
    assert done.returncode == 1 and done.stdout == "", done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"fedpar run: TLS handshake with the service at {tls_world.address} failed: its "
                           f"certificate is not signed by the CA in {other / 'ca.pem'}"), line
    assert line.endswith("give this operator the ca.pem of the folder that issued the service's certificate "
                         "(--certs DIR)"), line
    debug = subprocess.run([*command, "--debug"], capture_output=True, text=True, timeout=120, cwd=tls_world.root)
    assert debug.stderr.splitlines()[0] == line and "CERTIFICATE_VERIFY_FAILED" in debug.stderr  # gRPC's words
