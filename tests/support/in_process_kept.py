"""`fedpar ...` run by its main in the test's own process, with the process's environment put back after."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from support.in_process import run_main


def run_main_keeping_env(argv: list[str], capfd, cwd: Path | str | None = None) -> subprocess.CompletedProcess:
    """support.in_process.run_main, then os.environ as it was before: main sets GRPC_VERBOSITY, TORCH_CPP_LOG_LEVEL
    and OMP_WAIT_POLICY for its own process (setdefault), which a later test's subprocess would otherwise inherit."""
    environment = dict(os.environ)
    try:
        return run_main(argv, capfd, cwd)
    finally:
        for name in set(os.environ) - set(environment):
            del os.environ[name]
        os.environ.update(environment)
