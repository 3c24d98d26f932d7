"""An agent whose every message the test chooses, speaking raw gRPC to a real coordinator."""

from __future__ import annotations

import time

import grpc
import numpy as np

from fedpar.client.transfer import download_weights, upload_messages
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import CoordinatorStub, ModelLayout, channel_options


class ScriptedAgent:
    """An agent whose every message the test chooses; talks real gRPC to the coordinator."""

    def __init__(self, address: str, agent_id: str, num_examples: int = 100, max_chunk: int = 64 << 10):
        self.channel = grpc.insecure_channel(address, options=channel_options(64 << 20))
        self.stub = CoordinatorStub(self.channel)
        self.agent_id = agent_id
        self.max_chunk = max_chunk
        reply = self._join(pb.JoinRequest(agent_id=agent_id, num_examples=num_examples), timeout=60.0)
        self.auth = pb.AgentAuth(agent_id=agent_id, token=reply.token)

    def _join(self, request: pb.JoinRequest, timeout: float) -> pb.JoinReply:
        """Join, asking again while the coordinator says it is still restoring its checkpoint (UNAVAILABLE: it
        refuses every call then, and a loaded machine can make that last longer than one call's deadline)."""
        end = time.monotonic() + timeout
        while True:
            try:
                return self.stub.Join(request, timeout=10)
            except grpc.RpcError as err:
                restoring = err.code() == grpc.StatusCode.UNAVAILABLE and "restoring" in (err.details() or "")
                if not restoring or time.monotonic() > end:
                    raise
                time.sleep(0.1)

    def task(self, timeout: float = 20.0) -> pb.TrainTask:
        """Long-poll until a task arrives."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            reply = self.stub.PullTask(pb.PullTaskRequest(auth=self.auth, wait_seconds=1.0), timeout=10)
            if reply.WhichOneof("kind") == "task":
                return reply.task
            assert reply.WhichOneof("kind") != "shutdown_reason", reply.shutdown_reason
        raise TimeoutError(f"{self.agent_id} got no task")

    def shutdown_reason(self, timeout: float = 20.0) -> str:
        """Long-poll after the last upload until the coordinator says why it stops (no task may come)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            reply = self.stub.PullTask(pb.PullTaskRequest(auth=self.auth, wait_seconds=1.0), timeout=10)
            assert reply.WhichOneof("kind") != "task", reply
            if reply.WhichOneof("kind") == "shutdown_reason":
                return reply.shutdown_reason
        raise TimeoutError(f"{self.agent_id} was not told to stop")

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
