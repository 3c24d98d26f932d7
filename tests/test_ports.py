"""A port chosen now for a listener that starts later stays this run's: fedpar/ports.py's ReservedPort, and the
launchers that hand one to a process they start (the metrics endpoint of `serve`/`simulate` with --metrics-port 0).
On a busy machine a port merely free a moment ago was taken before the rank that was to serve on it started: a test
saw `fedpar serve --aggregator-ranks 2 --metrics-port 0` exit with "cannot serve metrics on 127.0.0.1:43543: Address
already in use; pick another --metrics-port (0 picks a free one)", for a 0 it had been given."""

from __future__ import annotations

import argparse
import errno
import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from fedpar.cli.observability import metrics_port_kept
from fedpar.ports import ReservedPort


def _taken_by_another(port: int) -> bool:
    """Whether a process binding ``port`` as most do (no SO_REUSEADDR) is refused."""
    with socket.socket() as other:
        try:
            other.bind(("127.0.0.1", port))
        except OSError as exc:
            assert exc.errno == errno.EADDRINUSE
            return True
        return False


def _serves_metrics(port: int) -> bool:
    registry = CollectorRegistry()
    Counter("fedpar_probe", "a probe", registry=registry).inc()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        return b"fedpar_probe_total 1.0" in scraped
    finally:
        server.shutdown()
        server.server_close()


def test_a_reserved_port_is_refused_to_others_and_served_by_its_listener_at_each_start():
    with ReservedPort() as port:
        assert _taken_by_another(port)
        assert _serves_metrics(port)
        assert _taken_by_another(port), "the listener's end gave the port away before the run's end"
        assert _serves_metrics(port)  # started again: the same port


def test_a_reserved_port_is_let_go_at_the_blocks_end():
    with ReservedPort() as port:
        assert _taken_by_another(port)
    assert not _taken_by_another(port)


def test_a_reserved_port_is_none_of_the_ports_to_avoid():
    with ReservedPort() as first:
        avoid = range(first - 2, first + 3)
    with ReservedPort(avoid=avoid) as port:
        assert port not in avoid


@pytest.mark.parametrize("given", [None, 0, "picked"])
def test_metrics_port_0_is_held_for_the_launch_and_another_is_passed_as_given(given):
    if given == "picked":
        with ReservedPort() as free:
            given = free
    args = argparse.Namespace(metrics_port=given, metrics_host="127.0.0.1")
    with metrics_port_kept(args) as port:
        if given is None or given:
            assert port == given
            return
        assert port > 0 and _taken_by_another(port)
        assert _serves_metrics(port)
