"""``fedpar simulate --tls``: the whole simulated federation over mutual TLS with throw-away certificates: one per
worker process (its host speaks for the clients it hosts, who have none of their own), none per client."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from fedpar.simulations.runner import SimulationConfig, run_simulation


@pytest.mark.parametrize("ranks", [1, 2])  # with 2, members dealt to rank 1 upload there over their host's connection
def test_simulation_runs_over_mutual_tls_and_removes_its_certificates(tmp_path, monkeypatch, ranks):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the throw-away CA goes
    seen: list[list[str]] = []
    on_round = lambda row: seen.append(sorted(p.name for p in Path(tmp_path).glob("fedpar-certs-*/*")))  # noqa: E731
    rows: list[dict] = []
    summary = run_simulation(SimulationConfig(clients=12, clients_per_round=6, rounds=3, workers=2,
                                              aggregator_ranks=ranks, tls=True, out=str(tmp_path / "run")),
                             on_round=lambda row: (rows.append(row), on_round(row)))
    assert seen[0] == ["ca.key", "ca.pem", "host-0.key", "host-0.pem", "host-1.key", "host-1.pem", "server.key",
                       "server.pem"]  # the hosts' certificates, not 12 clients'
    assert (summary["rounds"], summary["failed_rounds"]) == (3, 0)
    assert [(r["sampled"], r["reported"]) for r in rows] == [(6, 6)] * 3
    assert rows[-1]["test_accuracy"] > max(0.5, rows[0]["test_accuracy"])  # the model learns
    assert ranks == 1 or sum(r["r1_uploads"] for r in rows) > 0
    assert not list(Path(tmp_path).glob("fedpar-certs-*"))  # private keys do not outlive the run
