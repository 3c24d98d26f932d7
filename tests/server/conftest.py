"""Fixtures: a real coordinator on a loopback port, and a scripted agent that speaks raw gRPC."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from fedpar.aggregation import build_strategy
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.stubs import CoordinatorStub
from fedpar.protocol.codec import ModelLayout
from fedpar.protocol.messages import channel_options
from fedpar.client.transfer import download_weights, upload_messages
from fedpar.server.app import CoordinatorServer
from fedpar.server.config import CoordinatorConfig
from fedpar.server.coordinator import Coordinator

FAST = dict(rounds=1, overselect=1.0, deadline_seconds=30.0, heartbeat_seconds=1.0,
            liveness_timeout_seconds=10.0, max_chunk_bytes=64 << 10)


class ScriptedAgent:
    """An agent whose every message the test chooses; talks real gRPC to the coordinator."""

    def __init__(self, address: str, agent_id: str, num_examples: int = 100, max_chunk: int = 64 << 10):
        self.channel = grpc.insecure_channel(address, options=channel_options(64 << 20))
        self.stub = CoordinatorStub(self.channel)
        self.agent_id = agent_id
        self.max_chunk = max_chunk
        reply = self.stub.Join(pb.JoinRequest(agent_id=agent_id, num_examples=num_examples), timeout=10)
        self.auth = pb.AgentAuth(agent_id=agent_id, token=reply.token)

    def task(self, timeout: float = 20.0) -> pb.TrainTask:
        """Long-poll until a task arrives."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            reply = self.stub.PullTask(pb.PullTaskRequest(auth=self.auth, wait_seconds=1.0), timeout=10)
            if reply.WhichOneof("kind") == "task":
                return reply.task
            assert reply.WhichOneof("kind") != "shutdown_reason", reply.shutdown_reason
        raise TimeoutError(f"{self.agent_id} got no task")

    def download(self, task: pb.TrainTask, layout: ModelLayout) -> list[np.ndarray]:
        """The round's global weights."""
        return download_weights(self.stub, self.auth, task, layout, self.max_chunk, timeout=60)

    def upload(self, task: pb.TrainTask, arrays, num_examples: int, names=None, messages=None, timeout=60.0):
        """Send an update (or a hand-made message stream); returns the reply or raises grpc.RpcError."""
        if messages is None:
            names = names or [f"t{i}" for i in range(len(arrays))]
            layout = ModelLayout.of_arrays(names, arrays)
            messages = upload_messages(self.auth, task, layout, arrays, num_examples, 1, {}, self.max_chunk)
        return self.stub.UploadUpdate(iter(list(messages)) if isinstance(messages, list) else messages,
                                      timeout=timeout)

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()


@pytest.fixture
def start_coordinator(tmp_path):
    """Start a coordinator: ``start_coordinator(weights, names=None, strategy=None, **config)``."""
    servers = []

    def _start(weights, names=None, strategy=None, evaluate_fn=None, **overrides):
        names = names or [f"t{i}" for i in range(len(weights))]
        config = CoordinatorConfig(**{**FAST, **overrides})
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
