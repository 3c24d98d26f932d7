"""Durable whole-file writes: a temporary file beside the target, fsync, rename over it, fsync of the directory.

Readers, and a crash at any moment, see either the old file or the new one, never part of one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Sequence


@contextlib.contextmanager
def atomic_path(path: str | Path, mode: int | None = None) -> Iterator[Path]:
    """A new empty temporary file beside ``path`` for the block to write (by name); it then replaces ``path``.

    A link at ``path`` stays: what it points at is replaced. A device, a pipe or a socket there is refused
    (OSError EINVAL): a rename would replace it with a plain file. The temporary file (``.NAME.tmp-*``) is created
    exclusively. With ``mode`` (e.g. 0o600 for keys) it is
    created readable by the owner only and given ``mode`` before any byte is written, whatever the umask;
    without, it gets the umask's default. When the block ends it is fsynced, renamed over ``path`` and the
    directory fsynced; when the block raises it is removed.
    """
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    if path.exists() and not stat.S_ISREG(path.stat().st_mode) and not path.is_dir():
        raise OSError(errno.EINVAL, "a device, a pipe or a socket is there, not a file to replace", str(path))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else 0o600)
        try:
            try:
                if mode is not None:
                    os.fchmod(fd, mode)
            finally:
                os.close(fd)
            yield tmp
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)  # whoever wrote it by name may not have
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_directory(path.parent)
    except OSError as exc:
        # A full disk or a folder in the way, said of the temporary file (or of no file at all: a write to an open
        # file names none): name the file the caller asked for, which the user knows.
        if exc.errno is None or exc.filename not in (None, tmp, str(tmp), path.parent, str(path.parent)):
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


def atomic_write_bytes(path: str | Path, parts: Sequence[bytes | memoryview], mode: int | None = None) -> None:
    """Replace ``path`` by the concatenation of ``parts`` durably (see :func:`atomic_path`, which ``mode`` is for)."""
    with atomic_path(path, mode) as tmp, open(tmp, "r+b") as fh:
        for part in parts:
            fh.write(part)


def fsync_directory(path: str | Path) -> None:
    """Make renames and new entries in directory ``path`` durable."""
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
