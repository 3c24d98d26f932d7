"""A module a test adds to a fork server's preload, before fedpar's: it writes the file FEDPAR_TEST_TORN_DOWN names
when the server's interpreter runs its exit handlers, the start of its teardown, which parallel/fork_server_exit.py
cuts short (tests/parallel/test_fork_server_launch.py). An exit handler, not a module global's __del__: whether the
teardown deletes module globals differs between Pythons (3.12 on the GPU box did not, for this one)."""

from __future__ import annotations

import atexit
import os
from pathlib import Path

atexit.register(Path(os.environ["FEDPAR_TEST_TORN_DOWN"]).write_text, "torn down")
