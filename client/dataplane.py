"""The agent's side of the bulk data plane (wire format: :mod:`fedpar.protocol.dataplane`).

Downloads land with recv_into straight in the arrays the model is loaded from; uploads go out with
sendall of memoryviews of the update's arrays. The agent dials the host it dials for gRPC (it only ever
dials out), with TLS whenever its gRPC channel uses TLS. A :class:`DataPlaneError` (cannot connect, broken
connection) means "use the gRPC streams instead"; a :class:`DataPlaneRefused` is the coordinator's answer.
"""

from __future__ import annotations

import socket
import ssl
import time
from typing import Sequence

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from fedpar.client.transfer import finite_weights, matching_layout, upload_header
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import CodecError, ModelLayout, TensorAssembler, as_wire_array
from fedpar.protocol.dataplane import (MAX_MESSAGE_BYTES, OP_DOWNLOAD, OP_UPLOAD, TICKET_BYTES, DataPlaneError,
                                       DataPlaneRefused, Deadline, encode_frame, encode_preamble, read_status,
                                       recv_exact_into, send_all, send_views)
from fedpar.security.handshake import split_address

__all__ = ["DataPlaneError", "DataPlaneRefused", "DataPlaneTarget", "download", "upload", "refusal_text"]


class DataPlaneTarget:
    """Where and how to reach the data plane for one task."""

    def __init__(self, server: str, task: pb.TrainTask, ssl_context: ssl.SSLContext | None = None,
                 server_name: str | None = None):
        self.host = grpc_host(server)
        self.port = task.data_port
        self.ticket = bytes(task.data_ticket)
        self.ssl_context = ssl_context
        self.server_name = server_name or self.host

    def connect(self, op: int, deadline: Deadline) -> socket.socket:
        """An open (TLS if configured) connection with the preamble sent."""
        left = max(0.1, deadline.at - time.monotonic())
        if not 0 < self.port < 1 << 16:
            raise DataPlaneError(f"the task's data-plane port {self.port} is not a TCP port")
        try:
            sock = socket.create_connection((self.host, self.port), timeout=min(left, 10.0))
        except (OSError, ValueError) as exc:  # ValueError: a host name idna cannot encode (a label over 63 chars)
            raise DataPlaneError(f"cannot reach the data plane at {self.host[:100]!r} "
                                 f"port {self.port}: {exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(sock, server_hostname=self.server_name)
            send_all(sock, encode_preamble(op, self.ticket), deadline)
        except (OSError, ssl.SSLError, DataPlaneError) as exc:
            sock.close()
            raise DataPlaneError(f"data-plane connection failed: {exc}") from None
        return sock


def answers_as_data_plane(server: str, timeout: float) -> str | None:
    """What to change when ``server`` (an agent's --server, HOST:PORT) is a coordinator's data-plane port, which
    speaks no gRPC: it refuses a preamble with a ticket it never issued in its own status frame (a gRPC port, a web
    server, a closed port answer otherwise). None when it is not one, or nothing answers."""
    target = split_address(server.split("///", 1)[-1])
    if target is None:
        return None
    deadline = Deadline(timeout)
    try:
        with socket.create_connection(target, timeout=timeout) as sock:
            send_all(sock, encode_preamble(OP_DOWNLOAD, bytes(TICKET_BYTES)), deadline)
            read_status(sock, deadline, MAX_MESSAGE_BYTES)
    except DataPlaneRefused:
        return (f"{server} is a coordinator's data-plane port (the one its tasks offer for the weights), not its "
                "agents' port; give --server the coordinator's --port")
    except (OSError, ValueError, DataPlaneError):
        return None
    return None


def grpc_host(server: str) -> str:
    """The host part of a gRPC target such as ``host:port``, ``[::1]:port`` or ``dns:///host:port``."""
    target = server.split("///", 1)[-1]
    host = target.rsplit(":", 1)[0] if ":" in target else target
    return host.strip("[]")


def download(target: DataPlaneTarget, expected: ModelLayout, timeout: float) -> list[np.ndarray]:
    """The round's global weights, checked against ``expected`` and for NaN/Inf (like the gRPC download)."""
    deadline = Deadline(timeout)
    with target.connect(OP_DOWNLOAD, deadline) as sock:
        try:
            header = pb.ModelHeader.FromString(read_status(sock, deadline))
        except DecodeError:
            raise DataPlaneError("the coordinator sent a malformed ModelHeader") from None
        layout = matching_layout(header, expected)
        if header.total_bytes != layout.total_bytes:
            raise CodecError(f"ModelHeader total_bytes={header.total_bytes} but the tensors need {layout.total_bytes}")
        assembler = TensorAssembler(layout, max(1, layout.total_bytes))
        assembler.fill(lambda view: recv_exact_into(sock, view, deadline))
    return finite_weights(assembler)


def upload(target: DataPlaneTarget, auth: pb.AgentAuth, task: pb.TrainTask, layout: ModelLayout,
           arrays: Sequence[np.ndarray], num_examples: int, steps: int, metrics: dict[str, float],
           timeout: float) -> pb.UploadReply:
    """Send one update; returns the coordinator's reply or raises DataPlaneRefused with its reason."""
    arrays = [as_wire_array(a) for a in arrays]
    header = upload_header(auth, task, layout, num_examples, steps, metrics)
    deadline = Deadline(timeout)
    with target.connect(OP_UPLOAD, deadline) as sock:
        send_all(sock, encode_frame(header.SerializeToString()), deadline)
        read_status(sock, deadline)  # go ahead, or the refusal of the header
        send_views(sock, [memoryview(a.reshape(-1)).cast("B") for a in arrays if a.nbytes], deadline)
        body = read_status(sock, deadline)
    try:
        return pb.UploadReply.FromString(body)
    except DecodeError:
        raise DataPlaneError("the coordinator sent a malformed UploadReply") from None


def refusal_text(err: DataPlaneRefused) -> str:
    """``CODE_NAME: message`` as the agent reports gRPC refusals."""
    names = {code.value[0]: code.name for code in grpc.StatusCode}
    return f"{names.get(err.code, err.code)}: {err.message}"
