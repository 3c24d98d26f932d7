"""The processes a test starts: the port a coordinator prints, and the processes of a running tree, read from /proc
(tests that kill or stop one of a launcher's ranks)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path


def port_from(proc: subprocess.Popen, lines: list[str], listening: str = "(mutual TLS)",
              timeout: float = 90.0) -> int:
    """The port of the coordinator's "listening on 127.0.0.1:PORT <listening>" line, reading its text stdout into
    ``lines``; AssertionError with what it printed when it stops or times out first."""
    pattern = re.compile(r"listening on 127\.0\.0\.1:(\d+) " + re.escape(listening))
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if match := pattern.search(line):
            return int(match.group(1))
    raise AssertionError(f"coordinator did not start: {''.join(lines)}")


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
