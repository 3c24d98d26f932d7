"""A module a test adds to a fork server's preload: its global says, in the file FEDPAR_TEST_TORN_DOWN names, when
the server's interpreter tears its modules down (tests/parallel/test_fork_server_launch.py)."""

from __future__ import annotations

import os

from support.launched import SaysWhenTornDown

kept = SaysWhenTornDown(os.environ["FEDPAR_TEST_TORN_DOWN"])
