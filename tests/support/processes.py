"""The processes of a running tree, read from /proc (tests that kill or stop one of a launcher's ranks)."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``, oldest first."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append((int(fields[19]), int(entry.name)))  # starttime, pid
    return [p for _, p in sorted(found)]
