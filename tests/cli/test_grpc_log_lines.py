"""gRPC reads GRPC_VERBOSITY once, when it is imported: fedpar set it after its own modules had imported gRPC, so a
TLS handshake that failed printed gRPC's C-core INFO lines ("I1127 ... Handshake failed ...") beside fedpar's one
line. Real `fedpar run` processes (the console entry and `python -m fedpar.cli.main`) against a real control API
over mutual TLS on 127.0.0.1, with an operator certificate of another CA."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedpar.cli.main import main
from fedpar.security.tls import server_credentials, server_tls_files
from fedpar.server.run_control import RunControlServer
from fedpar.server.run_store import RunStore

ROOT = Path(__file__).resolve().parents[2]
GRPC_LINE = re.compile(r"^[IWEDF]\d{4} ", re.M)  # absl's prefix: severity, month and day


@pytest.fixture
def wrong_ca(tmp_path):
    """A control API whose certificates come from one CA, and an operator's folder from another."""
    assert main(["certs", "--out", str(tmp_path / "certs"), "--operators", "op"]) == 0
    assert main(["certs", "--out", str(tmp_path / "other"), "--operators", "op"]) == 0
    store = RunStore(tmp_path / "state.db")
    server = RunControlServer(store, lambda settings: (settings, ""), "127.0.0.1", 0,
                              server_credentials(server_tls_files(tmp_path / "certs")))
    yield ["--control", f"127.0.0.1:{server.port}", "--certs", str(tmp_path / "other"), "--operator", "op"]
    server.stop(0)
    store.close()


@pytest.mark.parametrize("module", ["fedpar", "fedpar.cli.main"])
def test_a_failed_handshake_is_fedpars_one_line_without_grpcs_own(wrong_ca, module):
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    done = subprocess.run([sys.executable, "-m", module, "run", "ls", *wrong_ca], cwd=ROOT, capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 1 and done.stdout == "", done
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr  # one line, not gRPC's as well
    assert done.stderr.startswith("fedpar run: TLS handshake with the service at 127.0.0.1:"), done.stderr
    debug = subprocess.run([sys.executable, "-m", module, "run", "ls", "--log-level", "debug", *wrong_ca], cwd=ROOT,
                           capture_output=True, text=True, env=env, timeout=120)
    assert debug.returncode == 1 and GRPC_LINE.search(debug.stderr), debug.stderr  # --log-level debug: gRPC's too
