"""A TLS handshake that fails is fatal for `fedpar client`, with the real cause in one line (issue 17): the
coordinator's certificate signed by another CA, issued for another name, or our certificate refused (foreign CA,
expired); a revoked agent is refused by name. Each is a real `fedpar client` against a real coordinator."""

from __future__ import annotations

import datetime as dt
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedpar.security.admission import Admission, RevocationList, append_revocation
from fedpar.security.certs import CertPaths, ensure_certs, load_ca, new_private_key, write_certificate, \
    write_private_key
from fedpar.security.handshake import diagnose_handshake
from fedpar.security.tls import client_tls_files, server_credentials, server_tls_files


def _agent_folder(root: Path, name: str, ca_from: Path, cert_from: Path, agent_id: str = "alice") -> Path:
    """A --certs folder holding ``ca_from``'s ca.pem and ``cert_from``'s certificate and key of ``agent_id``."""
    folder = root / name
    folder.mkdir()
    shutil.copy(ca_from / "ca.pem", folder / "ca.pem")
    for suffix in (".pem", ".key"):
        shutil.copy(cert_from / f"{agent_id}{suffix}", folder / f"{agent_id}{suffix}")
    return folder


def _expired_alice(ca_folder: Path, out: Path) -> None:
    """alice's certificate from the coordinator's own CA, expired yesterday."""
    ca_key, ca_cert = load_ca(CertPaths(ca_folder))
    key, now = new_private_key(), dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "alice")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=10)).not_valid_after(now - dt.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    out.mkdir()
    write_private_key(out / "alice.key", key)
    write_certificate(out / "alice.pem", cert)


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
    _expired_alice(ours, root / "expired-cert")
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
        foreign_cert=_agent_folder(root, "foreign-cert", ours, foreign),
        expired_cert=_agent_folder(root, "expired", ours, root / "expired-cert"))


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
        "expired certificate": (["--certs", str(w.expired_cert), "--agent-id", "alice"],
                                f"the coordinator refused this agent's certificate {w.expired_cert / 'alice.pem'}: "
                                "it expired on"),
        "revoked": (["--certs", str(w.ours), "--agent-id", "bob"],
                    "coordinator refused: PERMISSION_DENIED: agent 'bob' was revoked"),
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


def test_a_plaintext_coordinator_is_named(coordinator_factory, tls_world):
    server = coordinator_factory(None, min_available=5)
    problem = diagnose_handshake(server.address, client_tls_files("alice", tls_world.ours))
    assert problem is not None and "it does not answer TLS" in problem and "--insecure" in problem
