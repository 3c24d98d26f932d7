"""Shared by the attack tests: a coordinator of the harness's tiny model, and what every attacked run must show."""

from __future__ import annotations

from fedpar.aggregation import build_strategy
from fedpar.models import get_weights, weight_specs
from fedpar.server.app import CoordinatorServer
from fedpar.server.config import CoordinatorConfig
from fedpar.server.coordinator import Coordinator
from support.abuse import tiny_model

AGENTS, BEFORE, DURING, TRAIN = 3, 4, 3, 0.3  # seconds of training per round


def coordinator_server(credentials=None, admission=None, **overrides) -> CoordinatorServer:
    """A coordinator of ``tiny_model`` for a run of run_under_attack (not started)."""
    model = tiny_model()
    config = CoordinatorConfig(**{**dict(rounds=BEFORE + 1 + DURING, clients_per_round=AGENTS, min_available=AGENTS,
                                         overselect=1.0, deadline_seconds=30.0, heartbeat_seconds=1.0,
                                         liveness_timeout_seconds=10.0, local_epochs=1, batch_size=32,
                                         learning_rate=0.05), **overrides})
    coordinator = Coordinator(config, [n for n, _, _ in weight_specs(model)], get_weights(model),
                              build_strategy("fedavg"), admission=admission)
    return CoordinatorServer(coordinator, credentials=credentials)


def check_honest_rounds(run) -> None:
    """Every round completed with every honest agent, none refused, and the attacked rounds within 2x."""
    assert [r["status"] for r in run.rows] == ["ok"] * (BEFORE + 1 + DURING), run.rows
    assert all(r["reported"] == AGENTS for r in run.rows), run.rows
    assert all(a.stats.refused == 0 for a in run.agents), [a.stats.refusals for a in run.agents]
    assert run.ratio <= 2.0, (run.before, run.during)
