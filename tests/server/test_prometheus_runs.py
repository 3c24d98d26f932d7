"""A service's Prometheus endpoint keeps the series of the run it follows only: QA found 321 fedpar lines after 8 runs,
fedpar_round{run="25"} .. {run="30"} all still served, growing by some 40 series a run for the service's life."""

from __future__ import annotations

import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from fedpar.aggregation import build_strategy
from fedpar.server.app import CoordinatorServer
from fedpar.server.config import CoordinatorConfig
from fedpar.server.coordinator import Coordinator
from fedpar.server.prometheus_metrics import PrometheusExporter

NAMES = ["t0"]


def _server() -> CoordinatorServer:
    return CoordinatorServer(Coordinator(CoordinatorConfig(rounds=3, min_available=1), NAMES,
                                         [np.zeros(4, np.float32)], build_strategy("fedavg")))


def _row(round_id: int) -> dict:
    return {"round": round_id, "status": "ok", "reported": 1, "refused_busy": 1, "upload_bytes": 16,
            "download_bytes": 16, "round_seconds": 0.2, "r0_fold_s": 0.01, "dp_epsilon": 0.5}


def _runs_served(port: int) -> tuple[set[str], int]:
    """The run labels the endpoint serves, and how many fedpar samples it has."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples
               if s.name.startswith("fedpar")]
    return {s.labels["run"] for s in samples if "run" in s.labels}, len(samples)


def test_the_endpoint_serves_only_the_current_runs_series_and_the_service_wide_ones():
    exporter = PrometheusExporter(_server(), privacy=True, runs=True)
    port = exporter.serve("127.0.0.1", 0)
    counts = []
    try:
        for run_id in range(25, 31):
            exporter.follow(_server(), run_id)
            for round_id in (1, 2):
                exporter.observe(_row(round_id))
            runs, count = _runs_served(port)
            assert runs == {str(run_id)}, f"after run {run_id} started"
            counts.append(count)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        exporter.close()
    assert len(set(counts)) == 1, counts  # a run's series replace the one before's: the endpoint does not grow
    assert 'fedpar_round{run="30"} 2.0' in text
    assert 'fedpar_agents{state="live"}' in text  # service-wide series stay


def test_a_resumed_run_following_itself_keeps_its_series():
    exporter = PrometheusExporter(_server(), runs=True)
    port = exporter.serve("127.0.0.1", 0)
    try:
        exporter.follow(_server(), 4)
        exporter.observe(_row(1))
        exporter.follow(_server(), 4)
        exporter.observe(_row(2))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        exporter.close()
    assert 'fedpar_rounds_total{run="4",status="ok"} 2.0' in text
