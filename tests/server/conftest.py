"""Fixtures: a real coordinator on a loopback port, and a scripted agent that speaks raw gRPC."""

from __future__ import annotations

import pytest

from fedpar.aggregation import build_strategy
from fedpar.server.app import CoordinatorServer
from fedpar.server.config import CoordinatorConfig
from fedpar.server.coordinator import Coordinator
from support.scripted_agent import ScriptedAgent

FAST = dict(rounds=1, overselect=1.0, deadline_seconds=30.0, heartbeat_seconds=1.0,
            liveness_timeout_seconds=10.0, max_chunk_bytes=64 << 10,
            local_epochs=1, batch_size=32, learning_rate=0.05)  # quick local training (the defaults are 5, 16, 0.1)


@pytest.fixture
def start_coordinator(tmp_path):
    """Start a coordinator: ``start_coordinator(weights, names=None, strategy=None, **config)``."""
    servers = []

    def _start(weights, names=None, strategy=None, evaluate_fn=None, **overrides):
        names = names or [f"t{i}" for i in range(len(weights))]
        # rows go to disk only: tests read them back with coordinator.metrics.read_rows()
        metrics_path = tmp_path / "coordinators" / f"{len(servers)}" / "metrics.jsonl"
        config = CoordinatorConfig(**{**FAST, "metrics_path": metrics_path, **overrides})
        coordinator = Coordinator(config, names, weights, strategy or build_strategy("fedavg"),
                                  evaluate_fn=evaluate_fn)
        server = CoordinatorServer(coordinator)
        server.start()
        servers.append(server)
        return server

    yield _start
    for server in servers:
        server.stop()


@pytest.fixture
def agents():
    """Make scripted agents: ``agents(address, ids, num_examples=100)``; all closed afterwards."""
    made: list[ScriptedAgent] = []

    def _make(address, ids, num_examples=100):
        out = [ScriptedAgent(address, i, num_examples) for i in ids]
        made.extend(out)
        return out

    yield _make
    for agent in made:
        agent.close()
