"""A certificate of the wrong kind is said at start-up, in one line naming the file, by real `fedpar serve` and
`fedpar client` processes: an agent's certificate as the coordinator's, a CA's as an endpoint's, a leaf as the CA,
the coordinator's as an agent's, another folder's coordinator certificate beside a CA, and a certificate that
expired or is not valid yet (the coordinator's: every agent would fail its handshake while it waited for them; an
operator's: `fedpar run` said the service was not there)."""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedpar.security.certs import OPERATOR_ROLE, CertPaths, ensure_certs, load_ca, new_private_key, server_san, \
    write_certificate, write_private_key
from support.in_process import run_main

CLIENT_AUTH = ExtendedKeyUsageOID.CLIENT_AUTH


def _leaf(folder: Path, file: str, start: dt.timedelta, end: dt.timedelta, name: str = "localhost",
          usage=ExtendedKeyUsageOID.SERVER_AUTH, operator: bool = False) -> None:
    """FILE.pem and FILE.key in ``folder``: a certificate from its CA for ``name`` valid from now+``start`` to
    now+``end`` (by default a coordinator's)."""
    ca_key, ca_cert = load_ca(CertPaths(folder))
    key, now = new_private_key(), dt.datetime.now(dt.timezone.utc)
    subject = [x509.NameAttribute(NameOID.COMMON_NAME, name)]
    subject += [x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, OPERATOR_ROLE)] if operator else []
    cert = (x509.CertificateBuilder().subject_name(x509.Name(subject))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now + start).not_valid_after(now + end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(server_san(["localhost", "127.0.0.1"]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    write_private_key(folder / f"{file}.key", key)
    write_certificate(folder / f"{file}.pem", cert)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A 'fedpar certs' folder (agent alice) plus an expired and a not-yet-valid coordinator's certificate, and an
    expired certificate of agent alice and of operator ops."""
    folder = tmp_path_factory.mktemp("kinds") / "certs"
    ensure_certs(folder, ["alice"])
    _leaf(folder, "expired", -dt.timedelta(days=10), -dt.timedelta(days=1))
    _leaf(folder, "future", dt.timedelta(days=1), dt.timedelta(days=10))
    _leaf(folder, "alice-expired", -dt.timedelta(days=10), -dt.timedelta(days=1), "alice", CLIENT_AUTH)
    (folder / "operators").mkdir()
    _leaf(folder, "operators/ops", -dt.timedelta(days=10), -dt.timedelta(days=1), "ops", CLIENT_AUTH, operator=True)
    other, mixed = folder.parent / "other", folder.parent / "mixed"
    ensure_certs(other)
    shutil.copytree(folder, mixed)
    for name in ("server.pem", "server.key"):  # another folder's coordinator certificate beside this CA
        shutil.copy(other / name, mixed / name)
    return folder


def _tls(c: Path, cert: str, key: str, ca: str = "ca.pem") -> list[str]:
    return ["--tls-cert", str(c / cert), "--tls-key", str(c / key), "--tls-ca", str(c / ca)]


def _said_in_process(args: list[str], cwd: Path, capfd) -> tuple[int, str]:
    """`fedpar ARGS` by its main in this process: its exit code and stderr, as a process of its own would have them,
    without the seconds of a new interpreter."""
    done = run_main(args, capfd, cwd)
    return done.returncode, done.stderr


def test_a_certificate_of_the_wrong_kind_or_time_stops_serve_and_client_in_one_line(certs, tmp_path, capfd):
    serve = ["serve", "--port", "0", "--rounds", "1", "--min-available", "2", "--out", str(tmp_path / "run")]
    client = ["client", "--server", "127.0.0.1:9", "--threads", "1", "--give-up-after", "5"]
    cases = {  # name: (command line, what its one line says)
        "agent's as the coordinator's": ([*serve, *_tls(certs, "alice.pem", "alice.key")],
                                         f"{certs / 'alice.pem'} is the client certificate of 'alice' (an agent's or "
                                         "operator's ID.pem), not one for a coordinator; give the coordinator's"),
        "CA's as the coordinator's": ([*serve, *_tls(certs, "ca.pem", "ca.key")],
                                      f"{certs / 'ca.pem'} is a CA certificate (ca.pem), which signs certificates but "
                                      "is no endpoint's own"),
        "leaf as the CA": ([*serve, *_tls(certs, "server.pem", "server.key", "alice.pem")],
                           f"{certs / 'alice.pem'} is the client certificate of 'alice' (an agent's or operator's "
                           "ID.pem), not a CA certificate; give the ca.pem"),
        "expired coordinator's": ([*serve, *_tls(certs, "expired.pem", "expired.key")],
                                  f"{certs / 'expired.pem'} expired on "),
        "coordinator's not valid yet": ([*serve, *_tls(certs, "future.pem", "future.key")],
                                        f"{certs / 'future.pem'} is valid only from "),
        "another folder's coordinator's": ([*serve, "--certs", str(certs.parent / "mixed")],
                                           f"{certs.parent / 'mixed' / 'server.pem'} was not issued by the CA in "
                                           f"{certs.parent / 'mixed' / 'ca.pem'}: agents that check this coordinator "
                                           "with that ca.pem (as --certs DIR does) will refuse it; re-issue it"),
        "another certificate's key": ([*serve, *_tls(certs, "server.pem", "alice.key")],
                                      f"{certs / 'alice.key'} is not the private key of {certs / 'server.pem'}"),
        "a --certs folder that is not there": ([*serve, "--certs", str(certs.parent / "nowhere")],
                                               f"certificate {certs.parent / 'nowhere' / 'server.pem'} does not "
                                               "exist; make certificates with 'fedpar certs"),
        "coordinator's as an agent's": ([*client, "--agent-id", "localhost", *_tls(certs, "server.pem", "server.key")],
                                        f"{certs / 'server.pem'} is a coordinator's certificate (server.pem, for "
                                        "'localhost'), not one for an agent or operator"),
        "expired agent's": ([*client, "--agent-id", "alice", *_tls(certs, "alice-expired.pem", "alice-expired.key")],
                            f"{certs / 'alice-expired.pem'} expired on "),
        "expired operator's": (["run", "ls", "--control", "127.0.0.1:9", "--certs", str(certs), "--operator", "ops"],
                               f"{certs / 'operators' / 'ops.pem'} expired on "),
        "leaf as the agent's CA": ([*client, "--agent-id", "alice",
                                    *_tls(certs, "alice.pem", "alice.key", "alice.pem")],
                                   "not a CA certificate; give the ca.pem"),
    }
    results = {name: _said_in_process(args, tmp_path, capfd) for name, (args, _) in cases.items()}
    for name, (code, err) in results.items():
        assert code == 2, (name, err)
        lines = err.splitlines()  # nothing before it either (a revocation list read, a log line)
        assert len(lines) == 1 and lines[0].startswith("fedpar ") and cases[name][1] in lines[0], (name, err)


def test_a_private_key_readable_by_other_users_is_warned_about_with_the_fix(certs, tmp_path, capfd):
    exposed = tmp_path / "exposed"
    shutil.copytree(certs, exposed)
    (exposed / "alice.key").chmod(0o644)
    code, err = _said_in_process(["client", "--server", "127.0.0.1:9", "--certs", str(exposed), "--agent-id", "alice",
                                  "--threads", "1", "--give-up-after", "1"], tmp_path, capfd)
    warnings = [line for line in err.splitlines() if "readable by other users" in line]
    assert len(warnings) == 1, err
    assert f"private key {exposed / 'alice.key'} is readable by other users of this machine (mode 644): any of them " \
           f"can pose as agent 'alice'; make it readable by its owner only: chmod 600 {exposed / 'alice.key'}" \
           in warnings[0]
    assert code == 1 and "Traceback" not in err, err  # it still runs: unreachable, it gives up
    code, err = _said_in_process(["client", "--server", "127.0.0.1:9", "--certs", str(certs), "--agent-id", "alice",
                                  "--threads", "1", "--give-up-after", "1"], tmp_path, capfd)
    assert "readable by other users" not in err, err  # fedpar certs writes keys 0600


def _expire_ca(folder: Path) -> None:
    """Re-sign ``folder``'s CA certificate (same key and name, so its certificates still chain) as expired."""
    ca_key, ca_cert = load_ca(CertPaths(folder))
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(ca_cert.subject).issuer_name(ca_cert.subject)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(days=3650)).not_valid_after(now - dt.timedelta(days=1)))
    for extension in ca_cert.extensions:
        builder = builder.add_extension(extension.value, extension.critical)
    write_certificate(folder / "ca.pem", builder.sign(ca_key, hashes.SHA256()))


def test_an_expired_ca_is_said_by_serve_client_and_certs_instead_of_every_handshake_failing(tmp_path, capfd):
    folder = tmp_path / "old"
    ensure_certs(folder, ["alice"])
    _expire_ca(folder)
    cases = {
        "serve": ["serve", "--port", "0", "--certs", str(folder), "--min-available", "2", "--out", str(tmp_path / "r")],
        "client": ["client", "--server", "127.0.0.1:9", "--certs", str(folder), "--agent-id", "alice", "--threads", "1",
                   "--give-up-after", "5"],
        "certs": ["certs", "--out", str(folder), "--agents", "carol"],
    }
    results = {name: _said_in_process(args, tmp_path, capfd) for name, args in cases.items()}
    for name, (code, err) in results.items():
        lines = [line for line in err.splitlines() if line.startswith("fedpar ")]
        assert code == 2 and len(lines) == 1, (name, err)
        assert f"the CA certificate {folder / 'ca.pem'} expired on " in lines[0], (name, err)
        assert "make a new folder with 'fedpar certs --out NEW_DIR" in lines[0], (name, err)
    assert not (folder / "carol.pem").exists()


def test_a_key_that_is_not_the_certificates_says_how_to_get_a_pair_and_that_way_works(tmp_path, capfd):
    """It said only 'KEY is not the private key of CERT' (QA, the TLS guide): the fix it now names, re-issuing the
    pair, gives an agent that passes the check and dials."""
    assert run_main(["certs", "--out", "certs", "--agents", "alice,bob"], capfd, tmp_path).returncode == 0
    shutil.copy(tmp_path / "certs" / "bob.key", tmp_path / "certs" / "alice.key")
    agent = ["client", "--server", "127.0.0.1:9", "--certs", "certs", "--agent-id", "alice", "--give-up-after", "1"]
    done = run_main(agent, capfd, tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines() == ["fedpar client: certs/alice.key is not the private key of certs/alice.pem; "
                                        "give the key made with it (one lost: re-issue the pair, 'fedpar certs --out "
                                        "DIR --agents ID --force', or --server-name NAME for the coordinator's)"]
    assert run_main(["certs", "--out", "certs", "--agents", "alice", "--force"], capfd, tmp_path).returncode == 0
    done = run_main(agent, capfd, tmp_path)
    assert done.returncode == 1 and "unreachable for 1.0s" in done.stderr, done.stderr  # past the check, dialling
