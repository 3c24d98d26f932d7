"""Loopback ports for tests that must restart a multi-rank service on the port its agents already dial."""

from __future__ import annotations

import socket


def free_port_run(count: int, attempts: int = 50) -> int:
    """The first of `count` consecutive loopback ports that are all free now (rank r of a service takes first + r)."""
    for _ in range(attempts):
        held = []
        try:
            first = socket.socket()
            held.append(first)
            first.bind(("127.0.0.1", 0))
            start = first.getsockname()[1]
            if start + count - 1 > 65535:
                continue
            for offset in range(1, count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", start + offset))
            return start
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {count} consecutive free loopback ports in {attempts} tries")


def free_port() -> int:
    """A loopback port nothing listens on (free a moment ago): a coordinator that is down, the rendezvous port of
    processes a test starts (one that must stay free across restarts: fedpar.ports.ReservedPort)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        return held.getsockname()[1]
