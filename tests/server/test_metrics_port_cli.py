"""`fedpar serve --metrics-port` as a user runs it: the endpoint scraped over HTTP on 127.0.0.1 while the
coordinator waits for its agents."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.ports import free_port_run
from support.processes import started, stop_processes

ENDPOINT = re.compile(r"Prometheus metrics at http://127\.0\.0\.1:(\d+)/metrics")


def _serve(tmp_path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedpar", "serve", "--insecure", "--port", "0", "--metrics-port",
                             "0", "--min-available", "2", "--out", str(tmp_path / "out"), "--device", "cpu", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _metrics_port(proc: subprocess.Popen) -> int:
    said = []
    for line in proc.stderr:
        said.append(line)
        if match := ENDPOINT.search(line):
            return int(match.group(1))
    raise AssertionError(f"no metrics endpoint was printed: {''.join(said)}")


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.parametrize("ranks", [1, 2])
def test_aggregator_ranks_live_is_the_ranks_started_before_the_first_round(tmp_path, ranks):
    # Before its first round a coordinator was scraped as fedpar_aggregator_ranks_live 0, every rank lost: an
    # alert on lost ranks fired at each start, for as long as the coordinator waited for its agents.
    proc = _serve(tmp_path, "--aggregator-ranks", str(ranks))
    try:
        got = _scrape(_metrics_port(proc))
        assert got[("fedpar_aggregator_ranks_live", ())] == ranks
        assert got[("fedpar_round", ())] == 0
        assert got[("fedpar_agents", (("state", "live"),))] == 0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
    finally:
        stop_processes(proc)


class _Unbound:
    """An exporter that says which port it would serve on, binding nothing (tests bind 127.0.0.1 only)."""

    def serve(self, host: str, port: int) -> int:
        return 40123


def test_the_endpoint_said_for_an_ipv6_metrics_host_is_a_url_that_opens(capsys):
    # `--metrics-host ::1` printed http://::1:PORT/metrics, which curl and browsers cannot open (checked by hand on
    # the real command: http://[::1]:PORT/metrics answers).
    import argparse

    from fedpar.cli.observability import Observers

    observers = Observers(argparse.Namespace(metrics_host="::1", metrics_port=0, tensorboard=None))
    observers._serve_exporter(_Unbound())
    assert capsys.readouterr().err == "Prometheus metrics at http://[::1]:40123/metrics\n"


def test_metrics_port_0_is_the_same_port_after_the_coordinator_is_started_again(tmp_path):
    # simulate --checkpoint-dir starts its coordinator's process again when it dies; with --metrics-port 0 each start
    # took another free port, so a scraper pointed at the printed one lost the run after the restart.
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "fedpar", "simulate", "--clients", "4", "--rounds", "8",
                             "--checkpoint-dir", str(tmp_path / "ck"), "--metrics-port", "0", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 240
        while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < end, proc.stderr.read() if proc.poll() else "too slow"
            time.sleep(0.05)
        (coordinator,) = started(proc.pid)
        os.kill(coordinator, signal.SIGKILL)  # after round 2: started again, it resumes
        _, said = proc.communicate(timeout=240)
        assert proc.returncode == 0, said
    finally:
        stop_processes(proc)
    ports = ENDPOINT.findall(said)
    assert "starting every rank again" in said and len(ports) == 2 and ports[0] == ports[1], said


def test_serve_ranks_started_again_serve_metrics_on_the_same_port(tmp_path):
    # serve --aggregator-ranks with a checkpoint folder starts every rank again when rank 0 dies, on the same agents'
    # port; with --metrics-port 0 rank 0 took another free metrics port each start.
    proc = subprocess.Popen([sys.executable, "-m", "fedpar", "serve", "--insecure", "--port", str(free_port_run(2)),
                             "--aggregator-ranks", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--metrics-port",
                             "0", "--min-available", "2", "--out", str(tmp_path / "out"), "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    said: list[str] = []

    def until_listening() -> None:
        for line in proc.stdout:
            said.append(line)
            if "coordinator listening on" in line:
                return
        raise AssertionError("".join(said))

    try:
        until_listening()
        os.kill(started(proc.pid)[0], signal.SIGKILL)  # rank 0
        until_listening()  # every rank started again
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    finally:
        stop_processes(proc)
    ports = ENDPOINT.findall("".join(said))
    assert len(ports) == 2 and ports[0] == ports[1], "".join(said)
