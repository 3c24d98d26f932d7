"""Rank functions for the fork-server launch tests (tests/parallel/test_fork_server_launch.py): importable, so that
a fork server's child can run them."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def say_where() -> None:
    """One line on this process's standard output: the MARK it sees in its environment."""
    print(f"rank {os.environ['RANK']} sees MARK={os.environ.get('MARK')}", flush=True)
    print(f"rank {os.environ['RANK']} on stderr", file=sys.stderr, flush=True)


def wait_long(pid_file: str) -> None:
    """Say this process's pid in ``pid_file``, then wait (for its launcher's death to end it)."""
    Path(pid_file + ".tmp").write_text(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)
    time.sleep(120)


