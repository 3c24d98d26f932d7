"""Two `fedpar certs` run at once into one new folder (a provisioning script's `&`): before, each made a CA and both
exited 0, the folder left with one's ca.pem beside certificates the other's CA had signed, which every peer refuses.
Now each takes its turn: every certificate in the folder is the folder's CA's. Real processes (the claim is theirs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cryptography import x509

ROOT = Path(__file__).resolve().parents[2]


def _certs(out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedpar", "certs", "--out", str(out), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_certs_at_once_into_a_new_folder_leave_one_ca_that_issued_everything(tmp_path):
    for attempt in range(6):  # the race was lost 2 times in 3
        out = tmp_path / f"certs{attempt}"
        both = [_certs(out, "--agents", "alice", "--operators", "op"), _certs(out, "--agents", "bob")]
        said = [process.communicate(timeout=60) for process in both]
        assert [process.returncode for process in both] == [0, 0], said
        assert all("Traceback" not in err for _, err in said), said
        assert [out.count("created a new CA") for out, _ in said].count(1) == 1, said  # one made it, one took it
        ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
        for pem in ("server.pem", "alice.pem", "bob.pem", "operators/op.pem"):
            cert = x509.load_pem_x509_certificate((out / pem).read_bytes())
            cert.verify_directly_issued_by(ca)  # raises unless ca.pem's key signed it
        assert sorted(p.name for p in out.iterdir()) == sorted(
            ["ca.pem", "ca.key", "server.pem", "server.key", "alice.pem", "alice.key", "bob.pem", "bob.key",
             "operators"]), attempt  # and no lock file is left behind
