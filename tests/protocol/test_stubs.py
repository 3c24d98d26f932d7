"""The checked-in gRPC stubs are what fedpar.proto generates."""

import subprocess
import sys

import pytest


def test_generated_stubs_are_current():
    pytest.importorskip("grpc_tools")
    result = subprocess.run([sys.executable, "-m", "fedpar.protocol.generate", "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
