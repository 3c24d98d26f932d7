"""An exclusive lock that one process holds on a file for as long as its run lasts (fcntl.flock): one run per
checkpoint folder (or state file). The kernel drops it when its holder ends, however it ends (``kill -9`` too), so a
stale lock file never blocks the next run; the file names the holder's pid for the refusal of another."""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO


class LockHeld(Exception):
    """Another process holds the lock; ``pid``: the one its file names (None: it wrote none yet)."""

    def __init__(self, path: Path, pid: int | None):
        super().__init__(f"{path} is held by pid {pid}")
        self.path, self.pid = path, pid


@dataclass
class FileLock:
    """A held lock: its open file, and whether taking it made the file."""

    handle: IO[str]
    made: bool

    def release(self, refused: bool = False, remove: bool = False) -> None:
        """Let the lock go; a start ``refused`` takes away the file it made, and ``remove`` the file whoever made it
        (a crashed run's, taken over), while it holds it: a start beside it was refused, and the next one makes a
        new file. A file it cannot take away (its folder made read-only meanwhile) stays: no one holds it, and the
        error that matters to the run's user is the one its run met writing there."""
        try:
            if remove or (refused and self.made):
                Path(self.handle.name).unlink(missing_ok=True)
        except OSError:
            pass
        finally:
            self.handle.close()


def hold(name: Path) -> FileLock:
    """Take the lock on file ``name`` (made if missing) without waiting and write this process's pid in it;
    LockHeld if another process holds it."""
    while True:
        made = not name.exists()
        handle = open(name, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _pid_in(handle)
            handle.close()
            raise LockHeld(name, pid) from None
        if _same_file(handle, name):
            break
        handle.close()  # a refused start took the file away while we opened it: our lock is on no one's file
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return FileLock(handle, made)


def check_free(name: Path) -> None:
    """LockHeld if another process holds the lock on file ``name`` now (nothing if it is free or missing)."""
    try:
        handle = open(name)
    except OSError:  # missing: no run made it; unreadable: not this user's to tell
        return
    with handle:  # closing it lets go of the shared lock taken to test
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LockHeld(name, _pid_in(handle)) from None


def _same_file(handle: IO[str], name: Path) -> bool:
    """Whether ``handle`` is still the file at ``name`` (not one unlinked since it was opened)."""
    try:
        return os.fstat(handle.fileno()).st_ino == os.stat(name).st_ino
    except FileNotFoundError:
        return False


def _pid_in(handle: IO[str]) -> int | None:
    """The pid a lock file names (None: none yet, its holder is writing it)."""
    handle.seek(0)
    text = handle.read().strip()
    return int(text) if text.isdigit() else None
