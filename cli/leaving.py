"""Leaving a ``fedpar`` process once its command has returned, without the interpreter's teardown of its modules."""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

# The exit code :func:`leave` was given (empty until the command has returned).
_leaving_with: list[int] = []


def arrange() -> None:
    """Make :func:`leave`'s exit handler the last to run: call it before importing any module that adds one
    (logging, multiprocessing, torch), as exit handlers run last registered first."""
    atexit.register(_leave_without_teardown)


def leave(code: int) -> NoReturn:
    """Exit with ``code``: the threads are joined and every exit handler runs (logging's flush, temporary folders,
    child processes), and then the process ends before the interpreter tears down each module it loaded: with torch
    and gRPC loaded that is 0.3-0.6 s of CPU for nothing, at every command's end."""
    _leaving_with.append(code)
    sys.exit(code)


def _leave_without_teardown() -> None:
    if not _leaving_with:  # the command did not return (an error escaped): the interpreter's own exit says it
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # e.g. '| head' left: the interpreter's own exit handles it, as without this
        return
    os._exit(_leaving_with[0])
