"""``fedpar simulate --tls``: the whole simulated federation over mutual TLS with throw-away certificates."""

from __future__ import annotations

import tempfile
from pathlib import Path

from fedpar.simulations.runner import SimulationConfig, run_simulation


def test_simulation_runs_over_mutual_tls_and_removes_its_certificates(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the throw-away CA goes
    seen: list[list[str]] = []
    on_round = lambda row: seen.append(sorted(p.name for p in Path(tmp_path).glob("fedpar-certs-*/*")))  # noqa: E731
    summary = run_simulation(SimulationConfig(clients=2, rounds=2, local_epochs=1, workers=1, tls=True,
                                              out=str(tmp_path / "run")), on_round=on_round)
    assert seen[0] == ["ca.key", "ca.pem", "client-0000.key", "client-0000.pem", "client-0001.key",
                       "client-0001.pem", "server.key", "server.pem"]
    assert (summary["rounds"], summary["failed_rounds"]) == (2, 0)
    assert summary["final_test_accuracy"] > 0.3
    assert not list(Path(tmp_path).glob("fedpar-certs-*"))  # private keys do not outlive the run
