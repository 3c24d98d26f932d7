"""``fedpar certs`` output (subjects, SANs, usages, signatures, permissions), extending and revoking, and the
secure-by-default start-up checks of ``fedpar serve`` and ``fedpar client``."""

from __future__ import annotations

import datetime
import ipaddress
import os
import stat
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from fedpar.cli.main import main
from fedpar.security.admission import (Admission, AdmissionRefused, PeerIdentity, RevocationList, TokenList,
                                       hash_token, parse_revocations, parse_token_hashes)
from fedpar.security.certs import CertPaths, common_name, load_certificate
from support.in_process import run_main

def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A folder made by the real command: two agents, three server names."""
    out = tmp_path_factory.mktemp("certs") / "fl"
    rc = main(["certs", "--out", str(out), "--agents", "alice,bob", "--server-name", "localhost",
               "--server-name", "127.0.0.1", "--server-name", "fl.example.org", "--days", "30"])
    assert rc == 0
    return CertPaths(out)


def test_certs_writes_a_ca_a_server_and_one_certificate_per_agent(made):
    ca = load_certificate(made.ca_cert)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    server = load_certificate(made.server_cert)
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "fl.example.org"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert ExtendedKeyUsageOID.SERVER_AUTH in server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    for agent_id in ("alice", "bob"):
        cert = load_certificate(made.agent_cert(agent_id))
        cert.verify_directly_issued_by(ca)
        assert common_name(cert) == agent_id and cert.subject.rfc4514_string() == f"CN={agent_id}"
        assert ExtendedKeyUsageOID.CLIENT_AUTH in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert 29 <= (cert.not_valid_after_utc - cert.not_valid_before_utc).days <= 31
    keys = [made.ca_key, made.server_key, made.agent_key("alice"), made.agent_key("bob")]
    assert all(_mode(k) == 0o600 for k in keys)
    assert _mode(made.ca_cert) == 0o644
    serials = {load_certificate(p).serial_number for p in (made.server_cert, made.agent_cert("alice"),
                                                           made.agent_cert("bob"))}
    assert len(serials) == 3


def test_certs_adds_an_agent_to_an_existing_ca_and_keeps_everything_else(made, capsys):
    before = {p: p.read_bytes() for p in (made.ca_cert, made.ca_key, made.server_cert, made.agent_cert("alice"))}
    assert main(["certs", "--out", str(made.root), "--agents", "carol,alice"]) == 0
    assert "kept" in capsys.readouterr().out  # alice already had a certificate
    assert all(p.read_bytes() == data for p, data in before.items())
    carol = load_certificate(made.agent_cert("carol"))
    carol.verify_directly_issued_by(load_certificate(made.ca_cert))
    assert common_name(carol) == "carol" and _mode(made.agent_key("carol")) == 0o600


def test_certs_revokes_and_mints_tokens_without_storing_them(made):
    assert main(["certs", "--out", str(made.root), "--revoke", "bob",
                 "--revoke-cert", str(made.agent_cert("alice"))]) == 0
    ids, serials = parse_revocations(made.revoked.read_text())
    assert ids == {"bob"} and serials == {load_certificate(made.agent_cert("alice")).serial_number}
    assert main(["certs", "--out", str(made.root), "--mint-token", "dave"]) == 0
    token = (made.root / "dave.token").read_text().strip()
    assert _mode(made.root / "dave.token") == 0o600 and _mode(made.tokens) == 0o600
    assert token not in made.tokens.read_text()
    assert TokenList(made.tokens).value == {"dave": hash_token(token)}


def test_certs_refuses_agent_ids_that_are_not_safe_file_names(tmp_path, capsys):
    assert main(["certs", "--out", str(tmp_path / "x"), "--agents", "../evil"]) == 2
    assert "cannot be used in a certificate" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_serve_without_certificates_or_insecure_exits_with_advice(tmp_path, capsys):
    # main()'s return value is the process exit code (cli/main.py: raise SystemExit(main())); the real
    # processes of tests/security/test_deployed_form.py show the secure path end to end.
    assert main(["serve", "--port", "0", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "TLS is required" in err and "fedpar certs" in err and "--insecure" in err


def test_serve_and_client_name_the_missing_or_mismatched_file(made, tmp_path, capsys):
    assert main(["serve", "--port", "0", "--certs", str(tmp_path / "nowhere"), "--out", str(tmp_path)]) == 2
    assert "nowhere/server.pem does not exist" in capsys.readouterr().err
    assert main(["client", "--agent-id", "alice"]) == 2
    assert "fedpar certs" in capsys.readouterr().err
    assert main(["client", "--agent-id", "bob", "--certs", str(made.root), "--tls-cert", str(made.agent_cert("alice")),
                 "--tls-key", str(made.agent_key("alice"))]) == 2
    assert "certificate of agent 'alice', not of --agent-id 'bob'" in capsys.readouterr().err
    assert main(["serve", "--port", "0", "--tls-cert", str(made.server_cert), "--tls-key", str(made.server_key),
                 "--out", str(tmp_path)]) == 2  # server-only TLS with no way for agents to prove who they are
    assert "--enrollment-tokens" in capsys.readouterr().err
    assert main(["serve", "--port", "0", "--insecure", "--certs", str(made.root), "--out", str(tmp_path)]) == 2
    assert "choose one" in capsys.readouterr().err


def test_revocation_list_is_reread_when_its_file_changes(tmp_path):
    path = tmp_path / "revoked.txt"
    revocations = RevocationList(path)  # a missing file revokes nothing
    admission = Admission(revocations=revocations)
    admission.check_call("alice", None)
    path.write_text("# operators append here\nalice  # lost laptop\nserial:0A:FF\nserial:zz\n")
    with pytest.raises(AdmissionRefused) as info:
        admission.check_call("alice", None)
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(AdmissionRefused, match="serial aff"):
        admission.check_call("bob", PeerIdentity("bob", 0xAFF))
    admission.check_call("bob", PeerIdentity("bob", 0xB00))
    os.unlink(path)
    admission.check_call("alice", None)  # file gone: nothing revoked any more


def test_a_call_without_a_certificate_is_checked_where_the_policy_could_refuse_it(tmp_path):
    from fedpar.server.registry import AgentRegistry
    assert not Admission().checks_uncertified_calls  # plaintext, no revocation list: nothing to check per call
    assert Admission(require_certificate=True).checks_uncertified_calls
    path = tmp_path / "revoked.txt"
    admission = Admission(revocations=RevocationList(path))  # no file yet: an operator may still revoke
    assert admission.checks_uncertified_calls
    registry = AgentRegistry(60.0, admission=admission)
    record = registry.join("alice", 10, {})
    assert registry.authenticate("alice", record.token) is record
    path.write_text("alice\n")
    with pytest.raises(AdmissionRefused, match="revoked"):
        registry.authenticate("alice", record.token)
    open_registry = AgentRegistry(60.0)  # nothing to check: the session token alone admits the call
    bob = open_registry.join("bob", 10, {})
    assert open_registry.authenticate("bob", bob.token) is bob
    with pytest.raises(AdmissionRefused, match="certificate proves agent 'eve'"):  # a certificate is always checked
        open_registry.authenticate("bob", bob.token, PeerIdentity("eve"))


def test_token_file_is_validated_at_start_and_a_bad_edit_later_keeps_the_old_tokens(tmp_path):
    digest = hash_token("s3cret")
    assert parse_token_hashes(f"# comment\nalice sha256:{digest.upper()}\n") == {"alice": digest}
    path = tmp_path / "tokens.txt"
    with pytest.raises(ValueError, match="does not exist"):
        TokenList(path)
    path.write_text(f"alice {digest}\nbob s3cret\n")  # a token in clear instead of its hash
    with pytest.raises(ValueError, match="line 2"):
        TokenList(path)
    path.write_text(f"alice {digest}\n")
    tokens = TokenList(path)
    admission = Admission(token_hashes=tokens)
    admission.admit_join("alice", None, "s3cret")
    path.write_text(f"alice {digest}\nbob s3cret\n")
    assert tokens.refresh() == {"alice": digest}  # logged and ignored
    admission.admit_join("alice", None, "s3cret")
    with pytest.raises(AdmissionRefused, match="wrong enrollment token"):
        admission.admit_join("alice", None, "s3cret" * 100)


def test_insecure_is_explicit_and_warns(made, caplog):
    from fedpar.cli.main import build_parser
    from fedpar.cli.tlsopts import client_security, server_security

    with caplog.at_level("WARNING", logger="fedpar.security"):
        security = server_security(build_parser().parse_args(["serve", "--insecure"]))
    assert security.credentials is None and security.description.startswith("PLAINTEXT")
    assert "plaintext gRPC" in caplog.text and "any agent that can reach this port may join" in caplog.text
    secure = server_security(build_parser().parse_args(["serve", "--certs", str(made.root)]))
    assert secure.credentials is not None and secure.admission.require_certificate
    assert secure.admission.revocations.path == made.revoked  # watched by default with --certs
    client = client_security(build_parser().parse_args(["client", "--agent-id", "alice", "--certs", str(made.root)]))
    assert client.credentials is not None
    caplog.clear()
    with caplog.at_level("WARNING", logger="fedpar.security"):
        plain = client_security(build_parser().parse_args(["client", "--agent-id", "alice", "--insecure"]))
    assert plain.credentials is None and "--insecure: plaintext gRPC" in caplog.text


def test_an_agent_whose_key_was_handed_over_can_still_be_revoked_by_name(tmp_path, capfd):
    # The docs: give each agent only ca.pem and its own ID.pem/ID.key; the key moved to alice's machine must not make
    # 'fedpar certs --revoke alice' answer that there is no agent alice.
    out = tmp_path / "certs"
    fedpar = ["certs", "--out", str(out)]
    assert run_main([*fedpar, "--agents", "alice,bob"], capfd).returncode == 0
    (out / "alice.key").rename(tmp_path / "alice.key")
    (out / "bundle.pem").write_bytes((out / "ca.pem").read_bytes())  # a stray PEM names no agent
    done = run_main([*fedpar, "--revoke", "alice"], capfd)
    assert done.returncode == 0 and f"revoked agent alice in {out / 'revoked.txt'}" in done.stdout, done.stderr
    assert parse_revocations((out / "revoked.txt").read_text())[0] == {"alice"}
    done = run_main([*fedpar, "--revoke", "bundle"], capfd)
    assert done.returncode == 2 and "(agents there: alice, bob;" in done.stderr, done.stderr


def test_revoke_cert_refuses_a_certificate_whose_serial_would_revoke_nothing(tmp_path, capfd):
    # It said 'revoked certificate ...' for the CA's own certificate or another folder's, neither of which any agent
    # of this folder presents: the operator believed revoked what still worked.
    out, other = tmp_path / "certs", tmp_path / "other"
    for folder in (out, other):
        assert run_main(["certs", "--out", str(folder), "--agents", "alice"], capfd).returncode == 0
    cases = {out / "ca.pem": "is a CA certificate, whose serial no agent presents",
             other / "alice.pem": f"was not issued by the CA in {out / 'ca.pem'}",
             out: "is a folder; give the .pem file",
             # QA: it said 'revoked certificate .../server.pem', of a serial no client presents
             out / "server.pem": (f"fedpar certs: --revoke-cert {out / 'server.pem'} is the coordinator's "
                                  "certificate, which no agent presents, so revoking it would revoke nothing "
                                  "(revoked.txt is checked of agents and operators); to replace it, re-issue it: "
                                  f"'fedpar certs --out {out} --server-name NAME' (one per name agents dial)\n")}
    for pem, said in cases.items():
        done = run_main(["certs", "--out", str(out), "--revoke-cert", str(pem)], capfd)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and said in done.stderr, (pem, done.stderr)
    assert not (out / "revoked.txt").exists()


def test_force_renews_an_agents_certificate_and_leaves_the_coordinators_names_alone(tmp_path, capfd):
    # 'fedpar certs --agents alice --force' (what an agent with an expired certificate is told to run) re-issued
    # server.pem for localhost and 127.0.0.1 only, so every agent dialling fl.example.org failed after the next restart.
    out = tmp_path / "certs"
    fedpar = ["certs", "--out", str(out)]
    assert run_main([*fedpar, "--agents", "alice", "--server-name", "fl.example.org"], capfd).returncode == 0
    server, alice = out / "server.pem", out / "alice.pem"
    before = server.read_bytes(), alice.read_bytes()
    done = run_main([*fedpar, "--agents", "alice", "--force"], capfd)
    assert done.returncode == 0 and f"wrote {alice}" in done.stdout, done.stderr
    assert server.read_bytes() == before[0] and alice.read_bytes() != before[1]
    san = load_certificate(server).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["fl.example.org"]


def test_serve_with_a_certificate_but_no_key_or_a_key_but_no_certificate_says_which_is_missing(made, tmp_path,
                                                                                               capfd):
    # Either alone was said as 'no server certificate and key given', naming neither option.
    serve = ["serve", "--port", "0", "--out", str(tmp_path), "--tls-ca", str(made.ca_cert)]
    for given, said in ((["--tls-cert", str(made.server_cert)], f"--tls-cert {made.server_cert} needs its private key: "
                                                                 "add --tls-key KEY"),
                        (["--tls-key", str(made.server_key)], f"--tls-key {made.server_key} needs its certificate: add "
                                                               "--tls-cert PEM")):
        done = run_main([*serve, *given], capfd)
        assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == f"fedpar serve: {said}", done.stderr


def test_an_empty_enrollment_token_file_is_said_before_dialling(made, tmp_path, capfd):
    # It dialled with no token, and only the coordinator's refusal ('missing enrollment token') told why.
    empty = tmp_path / "dave.token"
    empty.write_text("\n")
    done = run_main(["client", "--server", "127.0.0.1:9", "--tls-ca", str(made.ca_cert), "--agent-id", "dave",
                     "--enrollment-token-file", str(empty), "--threads", "1", "--give-up-after", "2"], capfd)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"fedpar client: --enrollment-token-file {empty} is empty; give the "
                                                "token file 'fedpar certs --mint-token ID' wrote"]


def test_certs_makes_no_new_ca_beside_certificates_of_a_lost_one(tmp_path, capfd):
    # With ca.pem and ca.key gone, it made a new CA and kept server.pem and alice.pem of the old one: a folder whose
    # coordinator no agent of it would trust, nor it them.
    out = tmp_path / "certs"
    fedpar = ["certs", "--out", str(out)]
    assert run_main([*fedpar, "--agents", "alice"], capfd).returncode == 0
    (out / "ca.pem").unlink()
    (out / "ca.key").unlink()
    done = run_main([*fedpar, "--agents", "carol"], capfd)
    assert done.returncode == 2 and done.stderr == (f"fedpar certs: {out} holds certificates (alice.pem, server.pem) "
                                                    "but no ca.pem and ca.key: restore the CA that issued them, or "
                                                    "use a new --out\n"), done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["alice.key", "alice.pem", "server.key", "server.pem"]


def test_a_name_revoked_stays_revoked_for_a_new_certificate_and_both_ends_say_how_to_undo_it(
        tmp_path, coordinator_factory, raw_agents, capfd):
    # The refusal said 'ask for a new certificate', and 'fedpar certs --agents bob --force' issued one without a
    # word, which the coordinator refused all the same: bob is revoked by name.
    from fedpar.security.tls import channel_credentials, client_tls_files, server_credentials, server_tls_files

    out = tmp_path / "certs"
    fedpar = ["certs", "--out", str(out)]
    assert run_main([*fedpar, "--agents", "alice,bob"], capfd).returncode == 0
    assert run_main([*fedpar, "--revoke", "bob"], capfd).returncode == 0
    done = run_main([*fedpar, "--agents", "bob", "--force"], capfd)
    assert done.returncode == 0 and f"wrote {out / 'bob.pem'}" in done.stdout
    assert done.stderr == (f"fedpar certs: bob is revoked by name in {out / 'revoked.txt'}, so coordinators refuse its "
                           "certificate (a new one too) until its line is removed there\n")
    admission = Admission(revocations=RevocationList(out / "revoked.txt"), require_certificate=True)
    server = coordinator_factory(server_credentials(server_tls_files(out)), admission=admission, min_available=5)
    agent = raw_agents(server.address, channel_credentials(client_tls_files("bob", out)))
    with pytest.raises(grpc.RpcError) as err:
        agent.join("bob")
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert err.value.details().endswith(f"(if this is a mistake, its operator must remove 'bob' from "
                                        f"{out / 'revoked.txt'})"), err.value.details()


def test_certs_out_naming_a_file_says_so(made, capfd):
    # It said 'File exists: ca.pem in folder ...; remove it or pick another path (--debug shows the traceback)'.
    done = run_main(["certs", "--out", str(made.ca_cert), "--agents", "x"], capfd)
    assert done.returncode == 2 and done.stderr == (f"fedpar certs: --out {made.ca_cert} is a file; give the folder "
                                                    "of the certificates (made if missing)\n"), done.stderr


def test_a_revocation_line_naming_several_ids_revokes_each(caplog):
    # QA: 'a3,a4' (certs --revoke's own form) was taken as one id that matched nobody, so a3 and a4 still joined
    with caplog.at_level("WARNING", logger="fedpar.security"):
        ids, serials = parse_revocations("a1\na3,a4  # leaked\na5 a6\nserial:ff\n", "revoked.txt")
    assert ids == {"a1", "a3", "a4", "a5", "a6"} and serials == {255}
    assert "revoked.txt line 2 names 2 ids (a3, a4); each is revoked: write one id a line" in caplog.text


def test_revoke_in_a_folder_that_is_not_there_says_so_and_makes_nothing(tmp_path):
    """'fedpar certs --out cert --revoke bob' (a typo of certs) said 'no certificate ... for agent 'bob' ... (agents
    there: none; operators: none); check the name': the name was right, the folder was not (QA, the TLS guide)."""
    import subprocess
    import sys

    typo = tmp_path / "cert"
    done = subprocess.run([sys.executable, "-m", "fedpar", "certs", "--out", str(typo), "--revoke", "bob"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr == (f"fedpar certs: --revoke bob: {typo} does not exist; give --out the folder 'fedpar certs' "
                           "made (the one holding ca.pem and the agents' certificates)\n"), done.stderr
    assert not typo.exists()
    right = [sys.executable, "-m", "fedpar", "certs", "--out", str(tmp_path / "certs")]
    assert subprocess.run([*right, "--agents", "bob"], capture_output=True, timeout=60).returncode == 0
    done = subprocess.run([*right, "--revoke", "bob"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "revoked agent bob" in done.stdout, done.stderr


def test_server_names_given_as_a_list_are_refused_before_a_ca_is_made(tmp_path):
    """'--server-name fl.example.org,10.0.0.5' (as --agents takes a list) was refused after the CA was written, and
    said only that the name was neither an IP address nor a DNS name (QA, the TLS guide)."""
    import subprocess
    import sys

    certs = [sys.executable, "-m", "fedpar", "certs", "--out", "certs"]
    done = subprocess.run([*certs, "--server-name", "fl.example.org,10.0.0.5"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines() == ["fedpar certs: server name 'fl.example.org,10.0.0.5' is neither an IP address "
                                        "nor a DNS name; give each name the agents dial as its own --server-name, e.g. "
                                        "--server-name fl.example.org --server-name 10.0.0.5"]
    assert not (tmp_path / "certs").exists()
    done = subprocess.run([*certs, "--server-name", "fl.example.org", "--server-name", "10.0.0.5"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    names = load_certificate(tmp_path / "certs" / "server.pem").extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["fl.example.org"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]


def test_a_ca_key_that_is_not_the_key_of_ca_pem_is_refused_before_anything_is_issued(tmp_path, capfd):
    # QA: with another folder's ca.key beside ca.pem, 'fedpar certs --agents erin' wrote erin.pem (exit 0), which no
    # peer checking against ca.pem accepts
    out = tmp_path / "certs"
    assert run_main(["certs", "--out", str(out), "--agents", "alice"], capfd).returncode == 0
    assert run_main(["certs", "--out", str(tmp_path / "other")], capfd).returncode == 0
    (out / "ca.key").write_bytes((tmp_path / "other" / "ca.key").read_bytes())
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    done = run_main(["certs", "--out", str(out), "--agents", "erin"], capfd)
    assert done.returncode == 2 and done.stdout == "" and done.stderr == (
        f"fedpar certs: {out / 'ca.key'} is not the private key of {out / 'ca.pem'}, so no peer would accept what it "
        f"signs; restore the ca.pem and ca.key 'fedpar certs' made together in {out}, or use a new --out\n"), \
        done.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_ca_key_or_ca_pem_that_cannot_be_read_is_one_line_saying_which(tmp_path, capfd):
    # QA: a ca.key encrypted with a password was a TypeError traceback; a damaged ca.pem said only 'Unable to load
    # PEM file. See https://cryptography.io/... MalformedFraming'
    from cryptography.hazmat.primitives import serialization

    out = tmp_path / "certs"
    assert run_main(["certs", "--out", str(out), "--agents", "alice"], capfd).returncode == 0
    key, pem = (out / "ca.key").read_bytes(), (out / "ca.pem").read_bytes()
    (out / "ca.key").write_bytes(serialization.load_pem_private_key(key, None).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")))
    restore = f"restore the ca.pem and ca.key 'fedpar certs' made together in {out}, or use a new --out"
    done = run_main(["certs", "--out", str(out), "--agents", "erin"], capfd)
    assert done.returncode == 2 and done.stderr == (f"fedpar certs: {out / 'ca.key'} is not an unencrypted PEM private "
                                                    f"key; {restore}\n"), done.stderr
    (out / "ca.key").write_bytes(key)
    (out / "ca.pem").write_bytes(pem[:100])
    done = run_main(["certs", "--out", str(out), "--agents", "erin"], capfd)
    assert done.returncode == 2 and done.stderr == (f"fedpar certs: {out / 'ca.pem'} is not a PEM certificate; "
                                                    f"{restore}\n"), done.stderr
    assert not (out / "erin.pem").exists()


def test_a_name_given_twice_is_refused_before_anything_is_made(tmp_path, capfd):
    # QA: '--agents alice,alice' wrote alice.pem, then said 'kept alice.pem (exists; --force re-issues it)' of the
    # one it had just made; with --force it issued two, and '--mint-token dave,dave' replaced the token it had minted
    out = tmp_path / "certs"
    for option in ("--agents", "--operators", "--mint-token", "--revoke"):
        done = run_main(["certs", "--out", str(out), option, "bob,alice", option, "bob"], capfd)
        assert done.returncode == 2 and done.stdout == "" and done.stderr == (
            f"fedpar certs: {option} names bob more than once; give each name once\n"), done.stderr
    assert not out.exists()


def test_a_server_name_longer_than_a_common_name_may_be_is_in_the_certificate(tmp_path, capfd):
    # QA: a --server-name of 65 characters or more wrote a new CA, then said only "Attribute's length must be >= 1
    # and <= 64, but it was 82" (exit 2) and issued no server.pem
    long_name = "a" * 70 + ".example.org"
    out = tmp_path / "certs"
    done = run_main(["certs", "--out", str(out), "--server-name", long_name], capfd)
    assert done.returncode == 2 and done.stderr == (
        "fedpar certs: the server certificate needs one --server-name of 64 characters at most (its subject name); "
        "add one, e.g. the coordinator's IP address: --server-name 10.0.0.5\n"), done.stderr
    assert not out.exists()
    done = run_main(["certs", "--out", str(out), "--server-name", long_name, "--server-name", "10.0.0.5"], capfd)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    server = load_certificate(out / "server.pem")
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [long_name] and common_name(server) == "10.0.0.5"


def test_certificates_that_would_outlive_their_ca_are_refused(tmp_path, capfd):
    # QA: '--agents carol --days 36500' in a folder whose CA is valid ten years wrote carol.pem valid until 2126 (exit
    # 0): every peer refuses it once the CA expires
    out = tmp_path / "certs"
    assert run_main(["certs", "--out", str(out), "--agents", "alice"], capfd).returncode == 0
    ca = load_certificate(out / "ca.pem")
    left = (ca.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc)).days
    done = run_main(["certs", "--out", str(out), "--agents", "carol", "--days", "36500"], capfd)
    assert done.returncode == 2 and done.stdout == "" and done.stderr == (
        f"fedpar certs: --days 36500 is longer than the CA certificate {out / 'ca.pem'} is valid (until "
        f"{ca.not_valid_after_utc:%Y-%m-%d}), and peers refuse what it issued once it expires; give --days {left} or "
        "fewer, or make a new folder with 'fedpar certs --out NEW_DIR --agents ...'\n"), done.stderr
    assert not (out / "carol.pem").exists()
    done = run_main(["certs", "--out", str(out), "--agents", "carol", "--days", str(left)], capfd)
    assert done.returncode == 0 and load_certificate(out / "carol.pem").not_valid_after_utc <= ca.not_valid_after_utc


def test_certs_out_under_a_file_says_so_in_one_line(tmp_path, capfd):
    # QA: it said 'Not a directory: ... (--debug shows the traceback)' and exited 1
    (tmp_path / "notes.txt").write_text("kept")
    out = tmp_path / "notes.txt" / "certs"
    done = run_main(["certs", "--out", str(out), "--agents", "x"], capfd)
    assert done.returncode == 2 and done.stdout == "" and done.stderr == (
        f"fedpar certs: --out {out}: {tmp_path / 'notes.txt'} is a file, not a folder; move it aside or point --out "
        "at a folder\n"), done.stderr
    assert (tmp_path / "notes.txt").read_text() == "kept"


def test_an_option_naming_no_id_is_refused_before_anything_is_made(tmp_path, capfd):
    # QA: '--revoke ""' (or '--agents ,', e.g. from an unset variable) was taken as no option at all: a new folder got
    # a new CA and server certificate, exit 0
    out = tmp_path / "certs"
    for option, value in (("--revoke", ""), ("--agents", " , "), ("--mint-token", ","), ("--operators", "")):
        done = run_main(["certs", "--out", str(out), option, value], capfd)
        assert done.returncode == 2 and done.stdout == "" and done.stderr == (
            f"fedpar certs: error: argument {option}: {value!r} names no id; give one or more, e.g. alice,bob; see "
            "'fedpar certs --help'\n"), done.stderr
    assert not out.exists()


def test_certs_out_that_cannot_be_made_or_written_says_so_in_one_line(tmp_path, capfd):
    # QA: '--out /proc/certs' said '/proc/certs does not exist' of the folder it was to make, and '--out /sys/certs'
    # 'Operation not permitted: certs in folder /sys; ... (--debug shows the traceback)', exit 1
    for out, line in (("/proc/certs", "--out /proc/certs: cannot make the folder: No such file or directory; give a "
                                      "folder this user can make, or one that exists"),
                      ("/proc", "--out /proc: cannot write in the folder: No such file or directory; give a folder "
                                "this user can write")):
        done = run_main(["certs", "--out", out, "--agents", "alice"], capfd)
        assert done.returncode == 2 and done.stdout == "" and done.stderr == f"fedpar certs: {line}\n", done.stderr
