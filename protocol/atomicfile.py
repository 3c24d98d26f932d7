"""Durable whole-file writes: a temporary file beside the target, fsync, rename over it, fsync of the directory.

Readers, and a crash at any moment, see either the old file or the new one, never part of one.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Sequence


def atomic_write_bytes(path: str | Path, parts: Sequence[bytes | memoryview], mode: int | None = None) -> None:
    """Replace ``path`` by the concatenation of ``parts``: temporary file, fsync, rename, fsync of the directory.

    The temporary file (``.NAME.tmp-*`` beside ``path``) is created exclusively. With ``mode`` (e.g. 0o600 for
    keys) it is created readable by the owner only and given ``mode`` before any byte is written, whatever the
    umask; without, it gets the umask's default. On failure it is removed.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            if mode is not None:
                os.fchmod(fh.fileno(), mode)
            for part in parts:
                fh.write(part)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def fsync_directory(path: str | Path) -> None:
    """Make renames and new entries in directory ``path`` durable."""
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
