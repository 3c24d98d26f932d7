"""QA: `fedpar certs --revoke a` (or --revoke-cert) given twice appended a second line for the same agent or serial,
which an operator undoing the revocation then had to find and remove too. The second says it was revoked already
and adds nothing; the command's main in this process."""

from __future__ import annotations

from fedpar.security.admission import parse_revocations
from fedpar.security.certs import ensure_certs
from support.in_process import run_main


def test_a_second_revocation_of_one_agent_or_certificate_adds_no_line(tmp_path, capfd):
    certs = tmp_path / "certs"
    ensure_certs(certs, ["a", "b"])
    revoked = certs / "revoked.txt"
    for _ in range(2):
        assert run_main(["certs", "--out", str(certs), "--revoke", "a"], capfd).returncode == 0
    again = run_main(["certs", "--out", str(certs), "--revoke", "a,b"], capfd)
    assert again.returncode == 0
    assert again.stdout.splitlines() == [f"already revoked: agent a in {revoked}", f"revoked agent b in {revoked}"]
    for _ in range(2):
        cert = run_main(["certs", "--out", str(certs), "--revoke-cert", str(certs / "b.pem")], capfd)
        assert cert.returncode == 0
    assert cert.stdout.startswith(f"already revoked: certificate {certs / 'b.pem'} (serial "), cert.stdout
    lines = revoked.read_text().splitlines()
    assert [line.split("#")[0].strip() for line in lines][:2] == ["a", "b"] and len(lines) == 3, lines
    ids, serials = parse_revocations(revoked.read_text())
    assert ids == {"a", "b"} and len(serials) == 1
