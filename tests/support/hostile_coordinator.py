"""A stand-in coordinator whose every reply the test chooses: a real gRPC server on 127.0.0.1 port 0 speaking the
Coordinator service (protocol/fedpar.proto) to a real agent, replies given as messages or as raw bytes."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
from concurrent import futures
from typing import Callable

import grpc
import numpy as np

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import SERVICE_NAME, ModelLayout, build_payload, channel_options, layout_to_pb

Reply = pb.PullTaskReply | bytes


def _raw(message) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


class HostileCoordinator:
    """Answers Join with ``join_reply``, each PullTask with the next of ``tasks`` (then wait, or ``after``), downloads
    with ``download(request)`` (an iterable of ModelChunk or raw bytes), and records every upload and pull."""

    def __init__(self, tasks: list[Reply] | None = None, after: Reply | None = None,
                 join_reply: pb.JoinReply | bytes | None = None,
                 download: Callable[[pb.DownloadRequest], object] | None = None):
        self.replies: queue.Queue = queue.Queue()
        for reply in tasks or []:
            self.replies.put(reply)
        self.after = after if after is not None else pb.PullTaskReply(shutdown_reason="done")
        self.join_reply = join_reply if join_reply is not None else pb.JoinReply(token="t", heartbeat_seconds=5,
                                                                                 max_chunk_bytes=1 << 20)
        self.download = download or (lambda request: iter(()))
        self.pulls: list[pb.PullTaskRequest] = []
        self.uploads: list[object] = []
        self.joins = 0
        self.heartbeats = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(8), options=channel_options(64 << 20))
        handlers = {
            "Join": grpc.unary_unary_rpc_method_handler(self._join, pb.JoinRequest.FromString, _raw),
            "PullTask": grpc.unary_unary_rpc_method_handler(self._pull, pb.PullTaskRequest.FromString, _raw),
            "DownloadWeights": grpc.unary_stream_rpc_method_handler(self._download, pb.DownloadRequest.FromString,
                                                                    _raw),
            "UploadSmall": grpc.unary_unary_rpc_method_handler(self._upload_small, pb.SmallUpload.FromString, _raw),
            "UploadUpdate": grpc.stream_unary_rpc_method_handler(self._upload, pb.UploadChunk.FromString, _raw),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(self._heartbeat, pb.HeartbeatRequest.FromString, _raw),
            "Leave": grpc.unary_unary_rpc_method_handler(lambda r, c: pb.LeaveReply(), pb.LeaveRequest.FromString,
                                                         _raw),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()
        self.finished = threading.Event()  # set when a pull after the scripted replies came

    def _join(self, request, context):
        self.joins += 1
        return self.join_reply

    def _pull(self, request, context):
        self.pulls.append(request)
        try:
            return self.replies.get_nowait()
        except queue.Empty:
            self.finished.set()
            return self.after

    def _heartbeat(self, request, context):
        self.heartbeats += 1
        return pb.HeartbeatReply()

    def _download(self, request, context):
        yield from self.download(request)

    def _upload_small(self, request, context):
        self.uploads.append(request)
        return pb.UploadReply(accepted=True)

    def _upload(self, request_iterator, context):
        context.send_initial_metadata((("fedpar-upload", "admitted"),))
        self.uploads.append(list(request_iterator))
        return pb.UploadReply(accepted=True)

    def stop(self) -> None:
        """Stop serving."""
        self.server.stop(0)


def digits_layout() -> ModelLayout:
    """The layout of the agent's model in `fedpar client --dataset digits` (the default mlp)."""
    from fedpar.datasets import load_dataset
    from fedpar.models.for_data import build_model_for_data

    splits = load_dataset("digits")
    model = build_model_for_data("mlp", splits.input_shape, splits.num_classes)
    return ModelLayout((name, t.detach().numpy().dtype.name, tuple(t.shape)) for name, t in model.state_dict().items()
                       if t.is_floating_point())


def weights_of(layout: ModelLayout, value: float = 0.0) -> list[np.ndarray]:
    """Arrays filling ``layout`` with ``value``."""
    return [np.full(t.shape, value, dtype=t.dtype) for t in layout.tensors]


def inline_task(layout: ModelLayout, arrays: list[np.ndarray], round_id: int = 1, task_id: str = "t1",
                **fields) -> pb.PullTaskReply:
    """A task carrying its weights inside (a small model's)."""
    task = pb.TrainTask(round=round_id, task_id=task_id, deadline_seconds=fields.pop("deadline_seconds", 30.0),
                        local_epochs=fields.pop("local_epochs", 1), batch_size=fields.pop("batch_size", 16),
                        learning_rate=fields.pop("learning_rate", 0.1), **fields)
    task.weights_header.CopyFrom(pb.ModelHeader(round=round_id, tensors=layout_to_pb(layout),
                                                total_bytes=layout.total_bytes))
    task.weights = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    return pb.PullTaskReply(task=task)


def streamed(layout: ModelLayout, arrays: list[np.ndarray], chunk_bytes: int = 1 << 16) -> list[bytes]:
    """The DownloadWeights messages of ``arrays`` (header, then data chunks), serialized."""
    return list(build_payload(1, layout, arrays, chunk_bytes).messages())


def run_agent(coordinator: HostileCoordinator, cwd, seconds: float = 30.0, interrupt_after: float | None = None
              ) -> tuple[int, str]:
    """A real `fedpar client --dataset digits` against ``coordinator`` until it exits (Ctrl-C after
    ``interrupt_after`` seconds, or after ``seconds``): its exit code and what it printed (stdout and stderr)."""
    command = [sys.executable, "-m", "fedpar", "client", "--insecure", "--server", coordinator.address, "--agent-id",
               "a", "--dataset", "digits", "--poll", "1", "--max-backoff", "0.5", "--threads", "1"]
    agent = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
    try:
        out, _ = agent.communicate(timeout=interrupt_after or seconds)
    except subprocess.TimeoutExpired:
        agent.send_signal(signal.SIGINT)
        out, _ = agent.communicate(timeout=30)
    return agent.returncode, out
