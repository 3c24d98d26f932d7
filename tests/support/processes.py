"""The processes a test starts: the port a coordinator prints, and the processes of a running tree, read from /proc
(tests that kill or stop one of a launcher's ranks)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
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


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``: its children, theirs, and so on."""
    found, todo = [], [pid]
    while todo:
        below = children(todo.pop())
        found += below
        todo += below
    return found


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``signum`` (the SigCgt mask of /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:")), 0)
    return bool(mask >> (signum - 1) & 1)


def dump_stacks(pid: int) -> list[int]:
    """Have ``pid`` and every process below it that prints its stacks on SIGUSR1 (fedpar's processes:
    parallel/stopping.py dump_stacks_on_signal) print them on its stderr; the processes asked."""
    asked = [p for p in [pid, *descendants(pid)] if catches(p, signal.SIGUSR1)]
    for p in asked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGUSR1)
    return asked


@contextlib.contextmanager
def stacks_if_slow(seconds: float) -> Iterator[None]:
    """Run the block; if it takes more than ``seconds``, every fedpar process below this one prints its threads'
    stacks on stderr, once (a test that then times out shows where its processes wait)."""
    timer = threading.Timer(seconds, dump_stacks_below, (os.getpid(),))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def dump_stacks_below(pid: int) -> None:
    """:func:`dump_stacks` of the processes below ``pid`` only."""
    for child in children(pid):
        dump_stacks(child)
