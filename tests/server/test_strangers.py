"""Strangers cannot starve honest agents: silent pre-authentication upload streams and idle data-plane sockets,
from another process, against a real coordinator with real agents on loopback. Honest rounds keep completing,
at most 2x slower than the undisturbed rounds of the same run, and every honest download succeeds."""

from __future__ import annotations

from fedpar.aggregation import build_strategy
from fedpar.models import get_weights, weight_specs
from fedpar.server.app import CoordinatorServer
from fedpar.server.config import CoordinatorConfig
from fedpar.server.coordinator import Coordinator
from fedpar.simulations.abuse import idle_sockets, run_under_attack, silent_streams, tiny_model

AGENTS, BEFORE, DURING, TRAIN = 3, 4, 3, 0.3  # seconds of training per round


def coordinator_server(credentials=None, admission=None, **overrides) -> CoordinatorServer:
    """A coordinator of ``tiny_model`` for a run of run_under_attack (not started)."""
    model = tiny_model()
    config = CoordinatorConfig(**{**dict(rounds=BEFORE + 1 + DURING, clients_per_round=AGENTS, min_available=AGENTS,
                                         overselect=1.0, deadline_seconds=30.0, heartbeat_seconds=1.0,
                                         liveness_timeout_seconds=10.0, batch_size=32), **overrides})
    coordinator = Coordinator(config, [n for n, _, _ in weight_specs(model)], get_weights(model),
                              build_strategy("fedavg"), admission=admission)
    return CoordinatorServer(coordinator, credentials=credentials)


def _check(run, server) -> None:
    assert [r["status"] for r in run.rows] == ["ok"] * (BEFORE + 1 + DURING), run.rows
    assert all(r["reported"] == AGENTS for r in run.rows), run.rows
    assert all(a.stats.refused == 0 for a in run.agents), [a.stats.refusals for a in run.agents]
    assert run.ratio <= 2.0, (run.before, run.during)


def test_silent_upload_streams_never_touch_the_honest_budget():
    # 120 silent streams from the agents' own address: over --max-concurrent-rpcs and over both strangers' bounds.
    server = coordinator_server(max_concurrent_rpcs=40, max_unauthenticated_calls=32, max_unauthenticated_per_peer=16,
                                upload_header_seconds=1.0)
    run = run_under_attack(server, lambda s, *ev: (silent_streams, (s.address, 120, None, *ev)),
                           AGENTS, BEFORE, DURING, TRAIN)
    _check(run, server)
    assert server.strangers.evictions > 0 and len(server.strangers) == 0
    ends = " | ".join(run.attacker)
    assert "--max-unauthenticated-per-peer 16" in ends and "RESOURCE_EXHAUSTED" in ends, run.attacker


def test_idle_data_plane_sockets_hold_no_transfer_thread():
    # 100 idle connections against 16 handshake places (8 per address) and 12 transfer threads.
    server = coordinator_server(data_plane=True, max_dataplane_handshakes=16, max_dataplane_handshakes_per_peer=8,
                                dataplane_handshake_seconds=1.0)
    run = run_under_attack(server, lambda s, *ev: (idle_sockets, ("127.0.0.1", s.coordinator.data_port, 100, *ev)),
                           AGENTS, BEFORE, DURING, TRAIN)
    _check(run, server)
    plane = server.data_plane
    rounds = BEFORE + 1 + DURING
    assert (plane.downloads, plane.uploads) == (AGENTS * rounds, AGENTS * rounds)  # none fell back to gRPC
    assert run.attacker["closed"] > 100 and plane.strangers.evictions > 0
