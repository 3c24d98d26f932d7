"""The processes a test starts: the port a coordinator prints, and the processes of a running tree, read from /proc
(tests that kill or stop one of a launcher's ranks)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import signal
import subprocess
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path


# Run as `python -c DROP_ROOT_OVERRIDES COMMAND...`: drop the capabilities that let root write into a read-only
# folder, then become the command. In a fresh interpreter, not in a preexec_fn: the forked child of this process (whose
# agents' gRPC threads run) would run gRPC's fork handlers before exec, which sometimes abort it ("epoll_wait error:
# Bad file descriptor", exit -6: the command never started).
DROP_ROOT_OVERRIDES = """
import ctypes, os, sys
if os.geteuid() == 0:
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
os.execv(sys.argv[1], sys.argv[1:])
"""


def port_in_file(path: Path, process: subprocess.Popen, log: Path, seconds: float = 60.0) -> int:
    """The port ``process`` wrote to ``path`` (its --port-file) once it listens; the tail of its ``log`` as the failure
    when it ended first or ``seconds`` passed."""
    end = time.monotonic() + seconds
    while not path.exists() or not path.read_text().strip():
        assert process.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
        time.sleep(0.05)
    return int(path.read_text())


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


def interrupted_import(argv: list[str]) -> str:
    """A ``python -c`` script that runs ``fedpar`` with ``argv`` (cli/entry.py, as the console script does) and sends
    itself SIGINT exactly while the module named by its first argument is imported: a Ctrl-C in a command's first
    second, before its own handling of signals is in place."""
    return textwrap.dedent(f"""
        import importlib.abc, os, signal, sys

        MODULE = sys.argv[1]

        class InterruptOn(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == MODULE:
                    os.kill(os.getpid(), signal.SIGINT)
                return None

        sys.meta_path.insert(0, InterruptOn())
        sys.argv = {["fedpar", *argv]!r}
        from fedpar.cli.entry import entry
        entry()
    """)


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


def started(pid: int) -> list[int]:
    """The live processes multiprocessing started for ``pid``, oldest first: its children but its resource tracker
    and its fork server, and the fork server's children (forked there where ``pid`` may not fork: it has served
    gRPC, or runs threads)."""
    found = []
    for child in children(pid):
        line = _cmdline(child)
        if b"multiprocessing.forkserver" in line:
            found += children(child)
        elif b"resource_tracker" not in line:
            found.append(child)
    return sorted(found, key=_start_time)


def coordinator_child(launcher: int) -> int:
    """The process a simulate launcher runs its coordinator in: its forked copy (the same command line) where it
    forks, else the first process multiprocessing started for it (spawned on a machine with a GPU, whose first child
    is the resource tracker)."""
    line, kids = _cmdline(launcher), started(launcher)
    return next((p for p in kids if _cmdline(p) == line), kids[0])


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _start_time(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


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


def listening(pid: int) -> set[tuple[str, int]]:
    """The (address, port) of every TCP socket listening in ``pid`` and the processes below it (from /proc: the
    sockets of their file descriptors, looked up in /proc/net/tcp and tcp6)."""
    inodes = set()
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{p}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # the kernel writes the address as 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            found.add((str(ipaddress.ip_address(raw)), int(port, 16)))
    return found


def not_on_loopback(addresses: set[tuple[str, int]]) -> set[tuple[str, int]]:
    """Those of ``addresses`` other than 127.0.0.1 (as IPv4 or as IPv4-mapped IPv6) and ::1."""
    def loopback(address: str) -> bool:
        ip = ipaddress.ip_address(address)
        return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback
    return {a for a in addresses if not loopback(a[0])}


def stop_processes(*processes: subprocess.Popen | None, wait: float = 20.0) -> None:
    """SIGTERM each of ``processes`` still running (None: not started), then wait ``wait`` seconds for each, and
    kill the ones that did not end."""
    started = [p for p in processes if p is not None]
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in started:
        try:
            process.wait(wait)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
