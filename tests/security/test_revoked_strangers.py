"""A revoked certificate is refused at its first call, before anything is read or counted: a flood of silent
upload streams under it (from another process, over mutual TLS) is answered PERMISSION_DENIED at once, and the
honest agents' rounds go on at their undisturbed pace."""

from __future__ import annotations

from cryptography import x509

from fedpar.security.admission import Admission, RevocationList, append_revocation
from fedpar.security.certs import CertPaths, ensure_certs
from fedpar.security.tls import channel_credentials, client_tls_files, server_credentials, server_tls_files
from support.abuse import run_under_attack, silent_streams
from support.attacks import AGENTS, BEFORE, DURING, TRAIN, check_honest_rounds, coordinator_server


def test_a_revoked_certificate_is_refused_at_the_first_call(tmp_path):
    honest = [f"honest-{i}" for i in range(AGENTS)]
    ensure_certs(tmp_path, [*honest, "mallory"])
    paths = CertPaths(tmp_path)
    serial = x509.load_pem_x509_certificate(paths.agent_cert("mallory").read_bytes()).serial_number
    append_revocation(paths.revoked, serial=serial)
    admission = Admission(revocations=RevocationList(paths.revoked), require_certificate=True)
    # The honest budget is smaller than the flood: were the revoked streams counted, honest calls would starve.
    server = coordinator_server(server_credentials(server_tls_files(tmp_path)), admission, max_concurrent_rpcs=40)
    tls = {"cert": str(paths.agent_cert("mallory")), "key": str(paths.agent_key("mallory")), "ca": str(paths.ca_cert)}
    run = run_under_attack(server, lambda s, *ev: (silent_streams, (s.address, 100, tls, *ev)), AGENTS, BEFORE,
                           DURING, TRAIN, agent_kwargs=lambda i: {"credentials": channel_credentials(
                               client_tls_files(f"honest-{i}", tmp_path))})
    check_honest_rounds(run)
    assert run.attacker and all(k.startswith("PERMISSION_DENIED") and f"serial {serial:x}" in k and "revoked" in k
                                for k in run.attacker), run.attacker
    assert len(server.strangers) == 0 and server.strangers.evictions == 0  # never even counted
