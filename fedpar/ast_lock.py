"""One process-wide lock around ``ast.parse`` on CPython releases before 3.11.8, whose AST builder kept its recursion
depth in state shared by every thread (CPython gh-106905): two threads parsing at once (numpy reading an ``.npy``
header, as Flower's ``Array.numpy()`` does; torch checking an overload as it imports; a traceback drawing its carets)
raised ``SystemError: AST constructor recursion depth mismatch`` in whichever thread lost the race."""

from __future__ import annotations

import ast
import functools
import os
import sys
import threading

NEEDED = sys.implementation.name == "cpython" and sys.version_info < (3, 11, 8)

_lock = threading.RLock()  # re-entrant: a finalizer run by the collector inside one parse may parse again


def _renew_lock() -> None:
    """A forked child starts with the lock free: a parent's thread holding it does not exist there."""
    global _lock
    _lock = threading.RLock()


def serialize_ast_parse() -> bool:
    """Make ``ast.parse`` (and ``ast.literal_eval``, which calls it) run one thread at a time where this CPython needs
    it; True when the lock is in place."""
    if not NEEDED:
        return False
    if getattr(ast.parse, "fedpar_serialized", False):
        return True
    unlocked = ast.parse

    @functools.wraps(unlocked)
    def parse(*args, **kwargs):
        with _lock:
            return unlocked(*args, **kwargs)

    parse.fedpar_serialized = True
    ast.parse = parse
    os.register_at_fork(after_in_child=_renew_lock)
    return True
