"""The hand-written half of the gRPC protocol: conversions between protobuf messages and codec objects (a round's
global weights as the download's messages, serialized once: :class:`WeightPayload`), what a well-formed upload header
says (its tensors: :func:`specs_match`; its report: :func:`check_report`, checked by the coordinator's intake and by a
population host before it sums its members' updates), the gRPC channel options both ends use, and the agents' client
stub (:class:`CoordinatorStub`, with the raw-chunk fast path on the two streaming calls)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import grpc
import numpy as np

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import (ModelLayout, as_wire_array, decode_chunk_message, encode_data_message, iter_chunks,
                                   wire_bytes)

PROTOCOL_VERSION = 2  # 2: JoinPopulation carries its members as arrays (member_ids, num_examples, away)
SERVICE_NAME = "fedpar.v1.Coordinator"
DEFAULT_CHUNK_BYTES = 1 << 20
# Room for the protobuf framing around one chunk's payload.
FRAMING_BYTES = 64 << 10
# Initial metadata the coordinator sends on UploadUpdate once the upload holds a staging slot. Agents send
# the header, wait for it, and only then the data: an upload refused as busy costs no transfer and no
# coordinator memory (without the wait, every refused stream would have a flow-control window of data
# buffered in the coordinator's transport).
UPLOAD_ADMITTED = ("fedpar-upload", "admitted")
# An update of fewer bytes is small, at both ends. The agent sends it whole without waiting for admission (a
# refused one costs less than the extra round trip), as one UploadSmall when it fits a chunk; the coordinator
# checks and folds it on its event loop (the hand-off to a thread would cost more: a 100-agent round of a
# small model is 100 of these).
SMALL_UPDATE_BYTES = 256 << 10
MAX_CLIENT_METRICS = 64  # metrics in one update's report


def member_token(host_token: str, member_id: str) -> str:
    """The session token of population member ``member_id`` while its host's session is ``host_token``: both ends
    derive it (HMAC-SHA256), so a host's million members cost no token each on the wire or at the coordinator, and a
    new host session is a new session for every member."""
    digest = hmac.new(host_token.encode(), member_id.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest[:24]).decode()


def layout_from_pb(specs: Iterable[pb.TensorSpec], max_total_bytes: int | None = None) -> ModelLayout:
    """A :class:`ModelLayout` from wire TensorSpecs (raises CodecError on hostile headers)."""
    return ModelLayout(((s.name, s.dtype, tuple(s.shape)) for s in specs), max_total_bytes=max_total_bytes)


def specs_match(specs: Sequence[pb.TensorSpec], layout: ModelLayout) -> bool:
    """True when wire TensorSpecs name exactly ``layout``'s tensors (the usual header, checked without parsing it
    into a layout of its own)."""
    if len(specs) != len(layout.tensors):
        return False
    return all(s.name == t.name and s.dtype == t.dtype and tuple(s.shape) == t.shape
               for s, t in zip(specs, layout.tensors))


def check_report(num_examples: int, registered: int, local_epochs: int, steps: int,
                 metrics: Mapping[str, float]) -> None:
    """A ValueError saying what is wrong with an update's weight (``num_examples``: 1..``registered`` x
    ``local_epochs``), ``steps`` or ``metrics`` (at most MAX_CLIENT_METRICS finite values, names <= 64 characters)."""
    max_examples = registered * local_epochs
    if not 1 <= num_examples <= max_examples:
        raise ValueError(f"num_examples={num_examples} must be in 1..{max_examples} "
                         f"({registered} registered examples x {local_epochs} epochs)")
    if steps < 0:
        raise ValueError("steps must be >= 0")
    if len(metrics) > MAX_CLIENT_METRICS or not all(math.isfinite(v) and len(k) <= 64 for k, v in metrics.items()):
        raise ValueError(f"metrics: at most {MAX_CLIENT_METRICS} finite values with names <= 64 characters")


def layout_to_pb(layout: ModelLayout) -> list[pb.TensorSpec]:
    """Wire TensorSpecs for ``layout``."""
    return [pb.TensorSpec(name=t.name, dtype=t.dtype, shape=list(t.shape)) for t in layout.tensors]


@dataclass(frozen=True)
class WeightPayload:
    """One round's global model, held once: as pre-serialized ModelChunk messages, or (with the data plane)
    as one contiguous buffer that gRPC downloads are chunked from as they stream."""

    round_id: int
    layout: ModelLayout
    chunk_bytes: int
    header_message: bytes  # serialized ModelChunk{header}: the first message of every gRPC download
    model_header: bytes  # serialized ModelHeader (the data plane sends it before the bytes)
    encoded: tuple[bytes, ...] = ()  # pre-serialized data chunks (no data plane)
    flat: memoryview | None = None  # the model's bytes in one contiguous buffer (data plane)
    inline: bytes | None = None  # a small model's bytes, sent inside each TrainTask (no download call)

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data (without framing)."""
        return self.layout.total_bytes

    def messages(self) -> Iterator[bytes]:
        """The serialized ModelChunk messages of a gRPC download, header first."""
        yield self.header_message
        if self.flat is None:
            yield from self.encoded
            return
        for offset in range(0, len(self.flat), self.chunk_bytes):
            yield encode_data_message(offset, self.flat[offset:offset + self.chunk_bytes])


def build_payload(round_id: int, layout: ModelLayout, arrays: Sequence[np.ndarray], chunk_bytes: int,
                  flat: bool = False, inline_max_bytes: int = 0) -> WeightPayload:
    """Serialize ``arrays`` once: into data ModelChunk messages of at most ``chunk_bytes`` of data, or with
    ``flat`` into one contiguous buffer (which the data plane sends as it is). A model of at most
    ``inline_max_bytes`` also gets its bytes in one piece, to travel inside each task."""
    model_header = pb.ModelHeader(round=round_id, tensors=layout_to_pb(layout), total_bytes=layout.total_bytes)
    header_message = pb.ModelChunk(header=model_header).SerializeToString()
    if not flat:
        encoded = tuple(encode_data_message(offset, data) for offset, data in iter_chunks(arrays, chunk_bytes))
        inline = None
        if layout.total_bytes <= inline_max_bytes:
            inline = wire_bytes(arrays)
        return WeightPayload(round_id, layout, chunk_bytes, header_message, model_header.SerializeToString(),
                             encoded, inline=inline)
    buffer = np.empty(layout.total_bytes, np.uint8)
    for meta, array in zip(layout.tensors, arrays):
        if meta.nbytes:
            buffer[meta.offset:meta.offset + meta.nbytes] = as_wire_array(array).reshape(-1).view(np.uint8)
    return WeightPayload(round_id, layout, chunk_bytes, header_message, model_header.SerializeToString(),
                         flat=memoryview(buffer))


def channel_options(max_chunk_bytes: int) -> list[tuple[str, int]]:
    """gRPC options for a channel or server that carries chunks of at most ``max_chunk_bytes``."""
    limit = max_chunk_bytes + FRAMING_BYTES
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.http2.max_frame_size", 16 * 1024 * 1024 - 1),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnect to a restarted coordinator within about a second instead of gRPC's default backoff
        # (1 s growing to 120 s; while it waits, calls fail at once). Agents add their own jittered backoff.
        ("grpc.initial_reconnect_backoff_ms", 300),
        ("grpc.min_reconnect_backoff_ms", 300),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


def _serialize(message) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


class CoordinatorStub:
    """Like the generated stub, but uploads may mix pre-encoded bytes with messages, and downloads
    yield :class:`~fedpar.protocol.codec.RawData` for data chunks."""

    def __init__(self, channel: grpc.Channel):
        def method(name: str) -> str:
            return f"/{SERVICE_NAME}/{name}"

        self.Join = channel.unary_unary(method("Join"), request_serializer=_serialize,
                                        response_deserializer=pb.JoinReply.FromString)
        self.PullTask = channel.unary_unary(method("PullTask"), request_serializer=_serialize,
                                            response_deserializer=pb.PullTaskReply.FromString)
        self.DownloadWeights = channel.unary_stream(
            method("DownloadWeights"), request_serializer=_serialize,
            response_deserializer=lambda raw: decode_chunk_message(raw, pb.ModelChunk))
        self.UploadUpdate = channel.stream_unary(method("UploadUpdate"), request_serializer=_serialize,
                                                 response_deserializer=pb.UploadReply.FromString)
        self.UploadSmall = channel.unary_unary(method("UploadSmall"), request_serializer=_serialize,
                                               response_deserializer=pb.UploadReply.FromString)
        self.ReplyMessage = channel.unary_unary(method("ReplyMessage"), request_serializer=_serialize,
                                                response_deserializer=pb.UploadReply.FromString)
        self.Heartbeat = channel.unary_unary(method("Heartbeat"), request_serializer=_serialize,
                                             response_deserializer=pb.HeartbeatReply.FromString)
        self.Leave = channel.unary_unary(method("Leave"), request_serializer=_serialize,
                                         response_deserializer=pb.LeaveReply.FromString)
        self.JoinPopulation = channel.unary_unary(method("JoinPopulation"), request_serializer=_serialize,
                                                  response_deserializer=pb.JoinPopulationReply.FromString)
        self.PullHostTasks = channel.unary_unary(method("PullHostTasks"), request_serializer=_serialize,
                                                 response_deserializer=pb.PullHostTasksReply.FromString)
        self.UploadHostUpdates = channel.unary_unary(method("UploadHostUpdates"), request_serializer=_serialize,
                                                     response_deserializer=pb.HostUploadResults.FromString)
        self.SecAggExchange = channel.unary_unary(method("SecAggExchange"), request_serializer=_serialize,
                                                  response_deserializer=pb.SecAggReply.FromString)
