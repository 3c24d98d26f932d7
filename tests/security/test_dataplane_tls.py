"""The data plane under mutual TLS (real certificates, real sockets on 127.0.0.1): weights never travel in
plaintext beside a TLS control channel, and a ticket only works for the agent whose certificate it names."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import torch

from fedpar.aggregation import build_strategy
from fedpar.client import dataplane
from fedpar.client.agent import Agent, AgentConfig
from fedpar.client.trainer import LocalTrainer
from fedpar.datasets import ArrayDataset
from fedpar.models import get_weights, weight_specs
from fedpar.models.mlp import MLP
from fedpar.protocol.codec import ModelLayout
from fedpar.security.admission import Admission
from fedpar.security.sslcontext import client_ssl_context, server_ssl_context
from fedpar.security.tls import TlsFiles, client_tls_files, server_tls_files
from fedpar.server.app import CoordinatorServer
from fedpar.server.config import CoordinatorConfig
from fedpar.server.coordinator import Coordinator

FAST = dict(rounds=1, overselect=1.0, deadline_seconds=30.0, heartbeat_seconds=1.0, liveness_timeout_seconds=10.0,
            max_chunk_bytes=64 << 10)


def small_weights(seed: int = 0) -> list[np.ndarray]:
    """A tiny model's worth of float32 tensors."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in ((8, 4), (4,))]


@pytest.fixture
def tls_coordinator(pki):
    """``start(weights=None, names=None, data_tls=True, **config)`` -> a mutual-TLS CoordinatorServer."""
    servers: list[CoordinatorServer] = []

    def _start(weights=None, names=None, data_tls=True, **overrides) -> CoordinatorServer:
        weights = weights or small_weights()
        names = names or [f"t{i}" for i in range(len(weights))]
        coordinator = Coordinator(CoordinatorConfig(**{**FAST, "data_plane": True, **overrides}), names, weights,
                                  build_strategy("fedavg"), admission=Admission(require_certificate=True))
        server = CoordinatorServer(coordinator, credentials=pki.server_credentials(),
                                   data_tls=server_ssl_context(server_tls_files(pki.ours)) if data_tls else None)
        server.start()
        servers.append(server)
        return server

    yield _start
    for server in servers:
        server.stop(grace=0.2)


def _agent_tls(pki, agent_id: str):
    return client_ssl_context(client_tls_files(agent_id, pki.ours))


def _data(seed: int, n: int = 40) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    return ArrayDataset(rng.standard_normal((n, 4)).astype(np.float32) + 2.0 * np.eye(4, dtype=np.float32)[y], y)


def test_round_over_a_tls_data_plane_with_two_real_agents(pki, tls_coordinator):
    torch.manual_seed(0)
    model = MLP(in_features=4, hidden=(8,), num_classes=3)
    server = tls_coordinator(weights=get_weights(model), names=[n for n, _, _ in weight_specs(model)],
                             min_available=2, clients_per_round=2, batch_size=8, learning_rate=0.1)
    agents = [Agent(AgentConfig(server=server.address, agent_id=a, poll_seconds=1.0, give_up_after=20.0,
                                credentials=pki.agent_credentials(a), data_tls=_agent_tls(pki, a)),
                    LocalTrainer(MLP(in_features=4, hidden=(8,), num_classes=3), _data(i)))
              for i, a in enumerate(["alice", "bob"])]
    stats = {}
    threads = [threading.Thread(target=lambda a=a: stats.__setitem__(a.config.agent_id, a.run())) for a in agents]
    for t in threads:
        t.start()
    assert server.wait(60)
    for t in threads:
        t.join(30)
    assert all(s.accepted == 1 and not s.refusals for s in stats.values()), stats
    assert (server.data_plane.downloads, server.data_plane.uploads) == (2, 2)
    assert server.coordinator.metrics.last["reported"] == 2


def test_a_ticket_works_only_with_its_own_agents_certificate(pki, tls_coordinator, raw_agents):
    init = small_weights()
    server = tls_coordinator(min_available=1, clients_per_round=1)
    alice = raw_agents(server.address, pki.agent_credentials("alice"))
    alice.join("alice")
    task = alice.task()
    assert task.data_port and len(task.data_ticket) == 32
    layout = ModelLayout.of_arrays(["t0", "t1"], init)

    def target(ssl_context):
        return dataplane.DataPlaneTarget(server.address, task, ssl_context)

    # Bob's certificate with Alice's ticket: refused, for download and upload alike.
    for call in (lambda: dataplane.download(target(_agent_tls(pki, "bob")), layout, 10),
                 lambda: dataplane.upload(target(_agent_tls(pki, "bob")), alice.auth, task, layout, init, 10, 1, {}, 10)):
        with pytest.raises(dataplane.DataPlaneRefused) as err:
            call()
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
        assert "issued to agent 'alice'" in err.value.message and "'bob'" in err.value.message
    # No client certificate, or no TLS at all: the handshake fails, nothing is sent in plaintext.
    no_cert = client_ssl_context(TlsFiles(None, None, pki.paths.ca_cert))
    for ctx in (no_cert, None):
        with pytest.raises(dataplane.DataPlaneError):
            dataplane.download(target(ctx), layout, 10)
    # A certificate from another CA that also says "alice": refused at the handshake.
    foreign = client_ssl_context(TlsFiles(pki.foreign / "alice.pem", pki.foreign / "alice.key", pki.paths.ca_cert))
    with pytest.raises(dataplane.DataPlaneError):
        dataplane.download(target(foreign), layout, 10)
    # Alice's own certificate: the ticket is still good (failed attempts did not spend it).
    got = dataplane.download(target(_agent_tls(pki, "alice")), layout, 10)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(got, init))
    update = small_weights(5)
    assert dataplane.upload(target(_agent_tls(pki, "alice")), alice.auth, task, layout, update, 10, 1, {}, 10).accepted
    assert server.wait(20)
    for got, sent in zip(server.coordinator.weights, update):
        np.testing.assert_allclose(got, sent, rtol=1e-6)


def test_tls_control_plane_without_data_tls_keeps_weights_on_grpc(pki, tls_coordinator, raw_agents):
    server = tls_coordinator(data_tls=False, min_available=1, clients_per_round=1)
    alice = raw_agents(server.address, pki.agent_credentials("alice"))
    alice.join("alice")
    task = alice.task()
    assert server.data_plane is None and not task.data_port and not task.data_ticket
    # And an agent with TLS gRPC but no data-plane TLS context never uses an offered data plane.
    agent = Agent(AgentConfig(server=server.address, agent_id="bob", credentials=pki.agent_credentials("bob")),
                  LocalTrainer(MLP(in_features=4, hidden=(8,), num_classes=3), _data(0)))
    offered = type(task)(round=1, task_id="x", data_port=1, data_ticket=bytes(32))
    assert agent.data_plane(offered) is None
    agent.close()
