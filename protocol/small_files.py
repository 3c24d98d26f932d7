"""Reading a settings file a user names (a --config TOML, a run file, a token or revocation list, a certificate):
only a regular file, and only up to a bound, so that a mistaken path (/dev/zero, a FIFO, a dataset) is one line, not
a process that reads until the machine runs out of memory."""

from __future__ import annotations

import errno
import os
import stat
import tomllib
from pathlib import Path
from typing import Any

MAX_SETTINGS_FILE_BYTES = 16 << 20  # far above any settings file, certificate or token list fedpar reads


class NotASettingsFile(ValueError):
    """A path that is not a regular file, or one too large to be a settings file: ``reason`` says which."""

    def __init__(self, what: str, path: Path, reason: str):
        super().__init__(f"{what} {path} {reason}")
        self.reason = reason


def read_small_file(path: str | Path, what: str, limit: int = MAX_SETTINGS_FILE_BYTES) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes; an OSError for one that cannot be read
    (FileNotFoundError, IsADirectoryError, PermissionError: callers word those), a :class:`NotASettingsFile` naming
    ``what`` for anything else: not a regular file (a device; a FIFO, whose opening would wait for a writer), or
    larger."""
    path = Path(path)
    mode = path.stat().st_mode
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if not stat.S_ISREG(mode):
        raise NotASettingsFile(what, path, "is not a regular file")
    with open(path, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise NotASettingsFile(what, path, f"is larger than {limit >> 20} MiB: not a settings file")
    return data


def read_toml_file(path: str | Path, what: str) -> dict[str, Any]:
    """The TOML document of settings file ``path``; a ValueError, one line naming ``what`` and the path, for one that
    is missing, a folder, unreadable, not a regular file, too large, or not TOML in UTF-8."""
    path = Path(path)
    try:  # utf-8-sig: a byte-order mark (Windows Notepad's) was 'not valid TOML: Invalid statement (at line 1 ...)'
        return tomllib.loads(read_small_file(path, what).decode("utf-8-sig"))
    except FileNotFoundError:
        raise ValueError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"{what} {path} is a folder; give a TOML file") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {path} {not_utf8(exc)}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ValueError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    except NotASettingsFile as exc:
        raise ValueError(f"{exc}; give a TOML file") from None


def not_utf8(exc: UnicodeDecodeError) -> str:
    """Where a settings file's first byte that is not UTF-8 is, and what to do (was the codec's 'can't decode byte
    0xff in position 0')."""
    before = exc.object[:exc.start]
    line, column = before.count(b"\n") + 1, exc.start - before.rfind(b"\n")
    return (f"is not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at line {line}, column {column} (saved as UTF-16 "
            "or Latin-1?); save it as UTF-8")
