"""`fedpar ...` run by its main in the test's own process, logging as a fresh `fedpar` process would."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def logging_as_a_fresh_process() -> Iterator[None]:
    """The root logger without pytest's handlers while a command's main runs here: its setup_logging
    (logging.basicConfig) then logs to sys.stderr as it would in a process of its own, and so does a process it forks
    (which inherits the handler), so that capfd holds what the process's stderr would have; pytest's handlers and the
    root's level are put back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
