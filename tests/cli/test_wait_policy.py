"""Every fedpar command but train makes torch's OpenMP threads wait passively (cli/main.py): a coordinator and two
agents on one 2-core machine spun each other's cores, 0.3-4 s a digits round instead of 0.04 s
(benchmarks/deployed_threads.py). train, which has the cores to itself, keeps torch's default; a user's own
OMP_WAIT_POLICY stands. OpenMP reads it as torch loads: each case is a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# --help ends in the parser's SystemExit: the policy is set before that, as it is before torch loads in a real run
SCRIPT = """import contextlib, io, os, sys
from fedpar.cli.main import main
with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
    main(sys.argv[1:])
print(os.environ.get("OMP_WAIT_POLICY", "unset"))
"""


@pytest.mark.parametrize("argv, given, policy", [
    (["serve", "--help"], None, "PASSIVE"),
    (["client", "--help"], None, "PASSIVE"),
    (["simulate", "--help"], None, "PASSIVE"),
    (["train", "--help"], None, "unset"),
    (["client", "--help"], "ACTIVE", "ACTIVE"),
])
def test_commands_that_share_the_cores_wait_passively_before_torch_loads(argv, given, policy):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    done = subprocess.run([sys.executable, "-c", SCRIPT, *argv], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == policy
