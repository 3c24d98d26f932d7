"""Benchmark-side agents: real gRPC peers of the coordinator that move weights but do not train.

They use fedpar's own wire code (stubs, raw-chunk encoding, the upload message stream) so the coordinator
sees exactly what real agents send; they only skip local training, which is what "round overhead beyond
local training" means. Downloads are checked for order and size and then discarded, and every agent of a
worker process uploads the same pre-encoded update, so 100 agents of a 100M-parameter model fit in memory.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np

from fedpar.client import dataplane
from fedpar.client.runtime import data_plane_offered
from fedpar.client.transfer import ingest_address, upload_update
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.dataplane import OP_DOWNLOAD, Deadline, read_status, recv_exact_into
from fedpar.protocol.codec import (CoordinatorStub, ModelLayout, RawData, channel_options, encode_data_message,
                                   iter_chunks, layout_to_pb)


@dataclass
class SharedUpdate:
    """One update's pre-encoded data chunks, reused by every agent of a process."""

    layout: ModelLayout
    chunks: list[bytes]
    arrays: list[np.ndarray]

    @classmethod
    def build(cls, layout: ModelLayout, chunk_bytes: int, seed: int) -> "SharedUpdate":
        """Random finite float32 weights in ``layout``, encoded once."""
        rng = np.random.default_rng(seed)
        arrays = [rng.standard_normal(t.shape, dtype=np.float32) for t in layout.tensors]
        return cls(layout, [encode_data_message(o, d) for o, d in iter_chunks(arrays, chunk_bytes)], arrays)

    def messages(self, auth: pb.AgentAuth, task: pb.TrainTask, num_examples: int):
        """Header, the shared data chunks, end marker."""
        yield pb.UploadChunk(header=pb.UploadHeader(
            auth=auth, round=task.round, task_id=task.task_id, num_examples=num_examples, steps=1,
            tensors=layout_to_pb(self.layout), total_bytes=self.layout.total_bytes))
        yield from self.chunks
        yield pb.UploadChunk(end=pb.UploadEnd(total_bytes=self.layout.total_bytes, num_chunks=len(self.chunks)))


def download_and_discard(stub: CoordinatorStub, auth: pb.AgentAuth, task: pb.TrainTask, total_bytes: int) -> None:
    """Stream the round's weights, checking chunk order and the total, keeping nothing."""
    received = 0
    for message in stub.DownloadWeights(pb.DownloadRequest(auth=auth, round=task.round, task_id=task.task_id),
                                        timeout=3600):
        if isinstance(message, RawData):
            if message.offset != received:
                raise RuntimeError(f"chunk at {message.offset}, expected {received}")
            received += len(message.data)
    if received != total_bytes:
        raise RuntimeError(f"download ended at {received} of {total_bytes} bytes")


def data_plane_download_and_discard(target: dataplane.DataPlaneTarget, total_bytes: int) -> None:
    """Receive the round's weights over the data plane into one reused scratch buffer, checking the total."""
    deadline = Deadline(3600)
    scratch = memoryview(bytearray(4 << 20))
    with target.connect(OP_DOWNLOAD, deadline) as sock:
        header = pb.ModelHeader.FromString(read_status(sock, deadline))
        if header.total_bytes != total_bytes:
            raise RuntimeError(f"data-plane header says {header.total_bytes} bytes, expected {total_bytes}")
        left = total_bytes
        while left:
            take = min(left, len(scratch))
            recv_exact_into(sock, scratch[:take], deadline)
            left -= take


def _while_busy(call):
    """``call()``, retried with jittered backoff while the coordinator answers RESOURCE_EXHAUSTED (as agents do)."""
    backoff = 0.05
    while True:
        try:
            return call()
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            time.sleep(backoff * (0.5 + random.random()))
            backoff = min(2 * backoff, 1.0)


def run_light_agent(address: str, agent_id: str, shared: SharedUpdate, num_examples: int,
                    errors: list[BaseException]) -> None:
    """Join, then for every task: download, upload the shared update; until the coordinator says shutdown."""
    try:
        channel = grpc.insecure_channel(address, options=channel_options(64 << 20))
        stub = CoordinatorStub(channel)
        reply = _while_busy(lambda: stub.Join(pb.JoinRequest(agent_id=agent_id, num_examples=num_examples), timeout=60))
        auth = pb.AgentAuth(agent_id=agent_id, token=reply.token)
        ingest = {address: stub}
        while True:
            pulled = stub.PullTask(pb.PullTaskRequest(auth=auth, wait_seconds=5.0), timeout=3600)
            kind = pulled.WhichOneof("kind")
            if kind == "shutdown_reason":
                break
            if kind != "task":
                continue
            task = pulled.task
            target = ingest_address(address, task)  # the aggregator rank the task names, like a real agent
            if target not in ingest:
                ingest[target] = CoordinatorStub(grpc.insecure_channel(target, options=channel_options(64 << 20)))
            if data_plane_offered(task):  # whatever the coordinator offers, like a real agent
                data_plane_download_and_discard(dataplane.DataPlaneTarget(target, task), shared.layout.total_bytes)
                dataplane.upload(dataplane.DataPlaneTarget(target, task), auth, task, shared.layout, shared.arrays,
                                 num_examples, 1, {}, 3600)
            else:
                download_and_discard(ingest[target], auth, task, shared.layout.total_bytes)
                _while_busy(lambda: upload_update(ingest[target], shared.messages(auth, task, num_examples),
                                                  timeout=3600))
        channel.close()
    except BaseException as exc:  # reported by the worker
        errors.append(exc)


def run_light_worker(address: str, specs: list[tuple[str, str, tuple[int, ...]]], agent_ids: list[str],
                     chunk_bytes: int, seed: int) -> None:
    """Process entry point: one thread per agent, sharing one encoded update."""
    shared = SharedUpdate.build(ModelLayout(specs), chunk_bytes, seed)
    errors: list[BaseException] = []
    threads = [threading.Thread(target=run_light_agent, args=(address, a, shared, 100, errors)) for a in agent_ids]
    for t in threads:
        t.start()
        time.sleep(0.002)  # do not hit the coordinator with every Join in the same millisecond
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
