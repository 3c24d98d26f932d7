"""Bulk data plane: the framing both ends use to move model bytes over a plain (or TLS) TCP socket.

gRPC stays the control plane (join, tasks, heartbeats, refusals); only the tensors' bytes move here,
because gRPC Python copies every byte several times in user space. A TrainTask that carries
``data_port`` and ``data_ticket`` lets its agent use this plane for that task's download and upload.

Wire format (all integers little-endian; one operation per connection):

    agent -> coordinator   PREAMBLE: b"FPDP" | version u8 (=1) | op u8 (1 download, 2 upload) | ticket[32]

    download:
    coordinator -> agent   STATUS frame: code u8 | length u32 | body
                           code 0: body = serialized ModelHeader, then exactly header.total_bytes raw
                           tensor bytes (the tensors in header order, C order, little-endian, no padding)
                           code != 0: a refusal; body = UTF-8 message; the connection closes

    upload:
    agent -> coordinator   HEADER frame: length u32 | serialized UploadHeader (same fields as on gRPC)
    coordinator -> agent   STATUS frame: code 0 (empty body) = send the data now; else refusal + message
    agent -> coordinator   exactly UploadHeader.total_bytes raw tensor bytes
    coordinator -> agent   STATUS frame: code 0 with a serialized UploadReply, or a refusal + message

Status codes are gRPC status code numbers (``grpc.StatusCode.X.value[0]``) so the agent reports a refusal
exactly as it would one from the gRPC streams. Every length is bounded before anything is allocated
(:data:`MAX_FRAME_BYTES`); model sizes are bounded by the coordinator's ``max_model_bytes`` through the
header's tensor layout. A short read, a stall or a closed connection aborts the operation. No pickle.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Callable

MAGIC = b"FPDP"
VERSION = 1
OP_DOWNLOAD = 1
OP_UPLOAD = 2
TICKET_BYTES = 32  # 256 random bits
PREAMBLE = struct.Struct("<4sBB32s")
STATUS = struct.Struct("<BI")
LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = 16 << 20  # default bound on headers and replies (the coordinator uses its gRPC message limit)
MAX_MESSAGE_BYTES = 4096  # refusal messages are truncated to this
OK = 0


class DataPlaneError(ConnectionError):
    """The data connection broke, stalled or carried something that is not this protocol."""


class DataPlaneRefused(Exception):
    """The other side refused the operation; ``code`` is a gRPC status code number."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def encode_preamble(op: int, ticket: bytes) -> bytes:
    """The fixed-size first bytes of every data connection."""
    if len(ticket) != TICKET_BYTES:
        raise ValueError(f"a data-plane ticket has {TICKET_BYTES} bytes, got {len(ticket)}")
    return PREAMBLE.pack(MAGIC, VERSION, op, ticket)


def decode_preamble(raw: bytes) -> tuple[int, bytes]:
    """(op, ticket) from a preamble; raises DataPlaneError if it is not one of ours."""
    magic, version, op, ticket = PREAMBLE.unpack(raw)
    if magic != MAGIC:
        raise DataPlaneError("not a fedpar data-plane connection (bad magic)")
    if version != VERSION:
        raise DataPlaneError(f"data-plane version {version} is not supported (this end speaks {VERSION})")
    if op not in (OP_DOWNLOAD, OP_UPLOAD):
        raise DataPlaneError(f"unknown data-plane operation {op}")
    return op, ticket


class Deadline:
    """An absolute time limit applied to every blocking socket call of one operation."""

    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds

    def arm(self, sock: socket.socket) -> None:
        """Set the socket timeout to the time left; raise DataPlaneError once it has passed."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise DataPlaneError("the data transfer ran past its deadline")
        sock.settimeout(left)


def recv_exact_into(sock: socket.socket, view: memoryview, deadline: Deadline,
                    progress: Callable[[int], None] | None = None) -> None:
    """Fill ``view`` from ``sock`` with recv_into (no intermediate copy); short reads raise DataPlaneError.
    ``progress(n)`` is told of every ``n`` bytes as they arrive."""
    pos, end = 0, len(view)
    while pos < end:
        deadline.arm(sock)
        try:
            got = sock.recv_into(view[pos:], min(end - pos, 16 << 20))
        except socket.timeout:
            raise DataPlaneError("the data transfer stalled past its deadline") from None
        except OSError as exc:
            raise DataPlaneError(f"data connection failed: {exc}") from None
        if not got:
            raise DataPlaneError(f"connection closed after {pos} of {end} bytes")
        pos += got
        if progress is not None:
            progress(got)


def recv_exact(sock: socket.socket, nbytes: int, deadline: Deadline) -> bytes:
    """``nbytes`` bytes from ``sock`` (small frames only: callers bound ``nbytes`` first)."""
    buf = bytearray(nbytes)
    recv_exact_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def send_all(sock: socket.socket, data, deadline: Deadline) -> None:
    """sendall under the deadline (``data`` may be a memoryview: no copy)."""
    deadline.arm(sock)
    try:
        sock.sendall(data)
    except socket.timeout:
        raise DataPlaneError("the data transfer stalled past its deadline") from None
    except OSError as exc:
        raise DataPlaneError(f"data connection failed: {exc}") from None


def send_views(sock: socket.socket, views, deadline: Deadline, piece: int = 64 << 20) -> None:
    """Send each buffer in ``views`` (memoryviews of arrays) in pieces, re-arming the deadline per piece."""
    for view in views:
        for start in range(0, len(view), piece):
            send_all(sock, view[start:start + piece], deadline)


def read_frame(sock: socket.socket, deadline: Deadline, limit: int = MAX_FRAME_BYTES) -> bytes:
    """A length-prefixed frame, refusing lengths above ``limit`` before allocating."""
    (length,) = LENGTH.unpack(recv_exact(sock, LENGTH.size, deadline))
    if length > limit:
        raise DataPlaneError(f"frame of {length} bytes exceeds the limit of {limit}")
    return recv_exact(sock, length, deadline)


def encode_frame(body: bytes) -> bytes:
    """``body`` with its length prefix."""
    return LENGTH.pack(len(body)) + body


def encode_status(code: int, body: bytes = b"") -> bytes:
    """A status frame: 0 with a protobuf body, or a refusal code with a message."""
    return STATUS.pack(code, len(body)) + body


def refusal(code: int, message: str) -> bytes:
    """A refusal status frame carrying ``message`` (truncated to MAX_MESSAGE_BYTES)."""
    return encode_status(code, message.encode("utf-8", "replace")[:MAX_MESSAGE_BYTES])


def read_status(sock: socket.socket, deadline: Deadline, limit: int = MAX_FRAME_BYTES) -> bytes:
    """The body of a status-0 frame; raises DataPlaneRefused for a refusal."""
    code, length = STATUS.unpack(recv_exact(sock, STATUS.size, deadline))
    if length > limit:
        raise DataPlaneError(f"status frame of {length} bytes exceeds the limit of {limit}")
    body = recv_exact(sock, length, deadline)
    if code != OK:
        raise DataPlaneRefused(code, body.decode("utf-8", "replace"))
    return body

