"""examples/flower_client.py, an unchanged Flower NumPyClient, run as two fedpar agents (`fedpar client
--flower-client`) against `fedpar serve` running Flower's FedAvgM (`--strategy flower:...`), as separate processes
over loopback gRPC."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

ROOT = Path(__file__).resolve().parents[2]
FEDPAR = [sys.executable, "-m", "fedpar.cli.main"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def wait_for_port(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.1)
    raise AssertionError(f"the coordinator did not start: {proc.communicate(timeout=10)[0]}")


def test_the_flower_example_joins_fedpar_serve_as_two_agents(tmp_path):
    port_file, out = tmp_path / "port", tmp_path / "run"
    serve = subprocess.Popen([*FEDPAR, "serve", "--insecure", "--port", "0", "--port-file", str(port_file),
                              "--model", "mlp", "--dataset", "digits", "--min-available", "2",
                              "--clients-per-round", "2", "--rounds", "2", "--local-epochs", "1", "--lr", "0.1",
                              "--strategy", "flower:flwr.server.strategy:FedAvgM", "--strategy-option", "momentum=0.5",
                              "--out", str(out)],
                             cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    clients = []
    try:
        port = wait_for_port(port_file, serve)
        clients = [subprocess.Popen([*FEDPAR, "client", "--insecure", "--server", f"127.0.0.1:{port}",
                                     "--agent-id", agent_id, "--num-partitions", "2", "--partition-index", str(i),
                                     "--model", "mlp", "--flower-client", "examples/flower_client.py:client_fn",
                                     "--give-up-after", "60"],
                                    cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                   for i, agent_id in enumerate(["flower-a", "flower-b"])]
        outputs = [c.communicate(timeout=120)[0] for c in clients]
        serve_out = serve.communicate(timeout=60)[0]
    finally:
        for proc in [serve, *clients]:
            if proc.poll() is None:
                proc.kill()
    assert serve.returncode == 0, serve_out
    for client, text in zip(clients, outputs):
        assert client.returncode == 0 and "2 updates accepted, 0 refused" in text, text
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["ok", "ok"] and rows[-1]["test_accuracy"] > 0.5
    assert rows[-1]["federated_eval_accuracy"] > 0  # the Flower clients' own evaluate()
