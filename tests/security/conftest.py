"""Fixtures: real certificates (made once per module), coordinators behind TLS on a loopback port, and a
scripted agent that speaks raw gRPC over a channel the test chooses."""

from __future__ import annotations

import time
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from fedpar.aggregation import build_strategy
from fedpar.client.transfer import download_weights, upload_messages
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import CoordinatorStub, ModelLayout, channel_options
from fedpar.security.certs import CertPaths, ensure_certs
from fedpar.security.tls import channel_credentials, client_tls_files, server_credentials, server_tls_files
from fedpar.server.app import CoordinatorServer
from fedpar.server.config import CoordinatorConfig
from fedpar.server.coordinator import Coordinator

FAST = dict(rounds=1, overselect=1.0, deadline_seconds=30.0, heartbeat_seconds=1.0,
            liveness_timeout_seconds=10.0, max_chunk_bytes=64 << 10,
            local_epochs=1, batch_size=32, learning_rate=0.05)  # quick local training (the defaults are 5, 16, 0.1)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> SimpleNamespace:
    """Our CA with agents alice, bob, carol; and a foreign CA that also certifies an 'alice'."""
    root = tmp_path_factory.mktemp("pki")
    ensure_certs(root / "ours", ["alice", "bob", "carol"])
    ensure_certs(root / "foreign", ["alice"])
    ours = root / "ours"
    return SimpleNamespace(
        ours=ours, foreign=root / "foreign", paths=CertPaths(ours),
        server_credentials=lambda: server_credentials(server_tls_files(ours)),  # mutual TLS
        agent_credentials=lambda agent_id: channel_credentials(client_tls_files(agent_id, ours)))


def small_weights(seed: int = 0) -> list[np.ndarray]:
    """A tiny model's worth of float32 tensors."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in ((8, 4), (4,))]


class RawAgent:
    """An agent whose every call the test makes itself, over real gRPC with the given credentials."""

    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None):
        options = channel_options(64 << 20)
        self.channel = (grpc.secure_channel(address, credentials, options=options) if credentials is not None
                        else grpc.insecure_channel(address, options=options))
        self.stub = CoordinatorStub(self.channel)
        self.auth: pb.AgentAuth | None = None

    def join(self, agent_id: str, token: str = "", num_examples: int = 50) -> pb.JoinReply:
        """Join as ``agent_id``; keeps the session for later calls."""
        reply = self.stub.Join(pb.JoinRequest(agent_id=agent_id, num_examples=num_examples,
                                              enrollment_token=token), timeout=10)
        self.auth = pb.AgentAuth(agent_id=agent_id, token=reply.token)
        return reply

    def heartbeat(self, auth: pb.AgentAuth | None = None) -> pb.HeartbeatReply:
        """One heartbeat (with this agent's session unless ``auth`` is given)."""
        return self.stub.Heartbeat(pb.HeartbeatRequest(auth=auth or self.auth), timeout=10)

    def pull(self, wait: float = 0.5) -> pb.PullTaskReply:
        """One long-poll."""
        return self.stub.PullTask(pb.PullTaskRequest(auth=self.auth, wait_seconds=wait), timeout=10)

    def task(self, timeout: float = 20.0) -> pb.TrainTask:
        """Long-poll until a task arrives."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            reply = self.pull(1.0)
            if reply.WhichOneof("kind") == "task":
                return reply.task
        raise TimeoutError("no task")

    def train_and_upload(self, task: pb.TrainTask, names: list[str], layout: ModelLayout, num_examples: int = 10):
        """Download the round's weights, add 1 and upload them."""
        weights = download_weights(self.stub, self.auth, task, layout, 64 << 10, timeout=30)
        update = [w + 1.0 for w in weights]
        messages = upload_messages(self.auth, task, layout, update, num_examples, 1, {}, 64 << 10)
        return self.stub.UploadUpdate(iter(list(messages)), timeout=30)

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()


@pytest.fixture
def coordinator_factory(tmp_path):
    """``start(credentials, admission=None, weights=None, **config)`` -> a running CoordinatorServer (its metrics rows
    in a metrics.jsonl under ``tmp_path``)."""
    servers: list[CoordinatorServer] = []

    def _start(credentials, admission=None, weights=None, names=None, **overrides) -> CoordinatorServer:
        weights = weights or small_weights()
        names = names or [f"t{i}" for i in range(len(weights))]
        metrics_path = tmp_path / "coordinators" / f"{len(servers)}" / "metrics.jsonl"
        config = CoordinatorConfig(**{**FAST, "metrics_path": metrics_path, **overrides})
        coordinator = Coordinator(config, names, weights,
                                  build_strategy("fedavg"), admission=admission)
        server = CoordinatorServer(coordinator, credentials=credentials)
        server.start()
        servers.append(server)
        return server

    yield _start
    for server in servers:
        server.stop(grace=0.2)


@pytest.fixture
def raw_agents():
    """``make(address, credentials)`` -> RawAgent; all closed afterwards."""
    made: list[RawAgent] = []

    def _make(address, credentials):
        agent = RawAgent(address, credentials)
        made.append(agent)
        return agent

    yield _make
    for agent in made:
        agent.close()
