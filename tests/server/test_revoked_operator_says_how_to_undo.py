"""A revoked operator's `fedpar run` line says what undoes it, and the way it names works: a name revoked refuses a
new certificate of that name too (the line said 'ask for a new one' for both kinds of revocation). A real service
(`fedpar serve --state`, mutual TLS on 127.0.0.1, port 0) and `fedpar run` and `fedpar certs` as processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)
FEDPAR = [sys.executable, "-m", "fedpar"]


def _fedpar(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FEDPAR, *argv], cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.fixture
def service(tmp_path):
    """A service on port 0 whose operators are alice and bob; the control port's HOST:PORT."""
    assert _fedpar(tmp_path, "certs", "--out", "certs", "--agents", "site", "--operators", "alice,bob").returncode == 0
    port_file = tmp_path / "control.port"
    proc = subprocess.Popen([*FEDPAR, "serve", "--state", "state.db", "--certs", "certs", "--port", "0",
                             "--control-port", "0", "--control-port-file", str(port_file)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (port_file.exists() and port_file.read_text().strip()):
            time.sleep(0.05)
        yield f"127.0.0.1:{port_file.read_text().strip()}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _ls(cwd: Path, control: str, operator: str) -> subprocess.CompletedProcess:
    return _fedpar(cwd, "run", "ls", "--control", control, "--certs", "certs", "--operator", operator)


def test_a_name_revoked_says_a_new_certificate_is_refused_too_and_removing_the_line_undoes_it(service, tmp_path):
    assert _fedpar(tmp_path, "certs", "--out", "certs", "--revoke", "alice").returncode == 0
    done = _ls(tmp_path, service, "alice")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines() == ["fedpar run: operator 'alice' was revoked by name (in the service's "
                                        "revoked.txt), so a new certificate of that name is refused too; ask the "
                                        "service's operator to remove 'alice' there, or for a certificate under "
                                        "another name ('fedpar certs --operators NAME')"]
    _fedpar(tmp_path, "certs", "--out", "certs", "--operators", "alice", "--force")
    assert _ls(tmp_path, service, "alice").returncode == 2  # as the line says: a new certificate does not help
    (tmp_path / "certs" / "revoked.txt").write_text("")
    assert _ls(tmp_path, service, "alice").returncode == 0, "removing the name undoes it"


def test_a_certificate_revoked_says_to_reissue_it_and_the_reissued_one_is_taken(service, tmp_path):
    assert _fedpar(tmp_path, "certs", "--out", "certs", "--revoke-cert", "certs/operators/bob.pem").returncode == 0
    done = _ls(tmp_path, service, "bob")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    line, = done.stderr.splitlines()
    assert line.startswith("fedpar run: the certificate (serial ") and line.endswith(
        " of operator 'bob' was revoked; ask the service's operator for a new one ('fedpar certs --operators bob "
        "--force')"), line
    assert _fedpar(tmp_path, "certs", "--out", "certs", "--operators", "bob", "--force").returncode == 0
    assert _ls(tmp_path, service, "bob").returncode == 0, "the re-issued certificate is taken"
