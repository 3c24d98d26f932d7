"""The hand-written half of fedpar's wire protocol: a model's tensors as chunks, and the protobuf messages around them.

Tensors: raw little-endian buffers described by (name, dtype, shape) headers, streamed in chunks. A model travels
as the concatenation of its tensors' bytes, in order, with no padding. The sender cuts that byte stream into chunks
of at most ``chunk_bytes``; the receiver writes each chunk straight into preallocated arrays
(:class:`TensorAssembler`), checking order, bounds and size as it goes.

Each chunk travels in a data-chunk message, the only large messages fedpar sends, encoded by hand
(:func:`encode_data_message`, :func:`decode_chunk_message`). ``ModelChunk{data: DataChunk{offset, data}}`` and
``UploadChunk{data: ...}`` share one wire form (field 2 holding a DataChunk). Encoding it by hand writes the payload
once instead of through protobuf's arena, and decoding it hands out a zero-copy view of the payload. Anything not in
the canonical form falls back to the generated parser, so every valid encoding is still accepted.

Messages: conversions between protobuf messages and these objects (a round's global weights as the download's
messages, serialized once: :class:`WeightPayload`), what a well-formed upload header says (its tensors:
:func:`specs_match`; its report: :func:`check_report`, checked by the coordinator's intake and by a population host
before it sums its members' updates, and a client-side DP agent's clip bit in it, :func:`reported_clip`), a population
member's session token (:func:`member_token`), the gRPC channel
options both ends use, and the agents' client stub (:class:`CoordinatorStub`, with the raw-chunk fast path on the
two streaming calls).
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import hmac
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence

import grpc
import numpy as np
from google.protobuf.message import DecodeError, Message

from fedpar.protocol import fedpar_pb2 as pb

log = logging.getLogger(__name__)

# Only plain numeric dtypes cross the wire: no object arrays, no structured dtypes, no pickle.
# uint16 carries bfloat16 bit patterns (numpy has no bfloat16 dtype).
WIRE_DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "bool")
FLOAT_DTYPES = ("float16", "float32", "float64")
MAX_TENSORS = 100_000
MAX_DIMS = 8


# One tensor's (name, dtype, shape): what a ModelLayout is built from and gives back (``specs()``).
Spec = tuple[str, str, tuple[int, ...]]


class CodecError(ValueError):
    """A tensor header or data stream that does not describe a valid model."""


class ModelTooLarge(CodecError):
    """A tensor header that describes more bytes than the receiver's limit allows."""


@dataclass(frozen=True)
class TensorMeta:
    """Name, dtype, shape and byte range of one tensor inside the concatenated stream."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


class ModelLayout:
    """The ordered tensor headers of a model (or of an encoded update) and where each tensor's bytes sit in the stream.

    Strategies see the same weights as an unnamed array list: aggregation/accumulator.ShapesAndDtypes.
    """

    def __init__(self, specs: Iterable[tuple[str, str, Sequence[int]]], max_total_bytes: int | None = None):
        tensors: list[TensorMeta] = []
        offset = 0
        names: set[str] = set()
        for name, dtype, shape in specs:
            if len(tensors) >= MAX_TENSORS:
                raise CodecError(f"more than {MAX_TENSORS} tensors")
            if not name or len(name) > 1024:
                raise CodecError(f"tensor {len(tensors)}: name must be 1..1024 characters")
            if name in names:
                raise CodecError(f"tensor {name!r} appears twice")
            if dtype not in WIRE_DTYPES:
                raise CodecError(f"tensor {name!r}: dtype {dtype[:32]!r} is not one of {', '.join(WIRE_DTYPES)}")
            shape = tuple(int(d) for d in shape)
            if len(shape) > MAX_DIMS:
                raise CodecError(f"tensor {name!r}: shape has {len(shape)} dims, at most {MAX_DIMS} allowed")
            if any(d < 0 for d in shape):
                raise CodecError(f"tensor {name!r}: shape {shape} must have non-negative dims")
            numel = 1
            for d in shape:
                numel *= d
                if numel > (1 << 40):
                    raise CodecError(f"tensor {name!r}: shape {shape} is absurdly large")
            nbytes = numel * np.dtype(dtype).itemsize
            tensors.append(TensorMeta(name, dtype, shape, offset, nbytes))
            names.add(name)
            offset += nbytes
            if max_total_bytes is not None and offset > max_total_bytes:
                raise ModelTooLarge(f"model is larger than the limit of {max_total_bytes} bytes")
        self.tensors: tuple[TensorMeta, ...] = tuple(tensors)
        self.total_bytes = offset
        self._starts = [t.offset for t in self.tensors]

    @classmethod
    def of_arrays(cls, names: Sequence[str], arrays: Sequence[np.ndarray]) -> "ModelLayout":
        """Layout of ``arrays`` under ``names``."""
        if len(names) != len(arrays):
            raise CodecError(f"{len(names)} names for {len(arrays)} arrays")
        return cls((n, a.dtype.name, a.shape) for n, a in zip(names, arrays))

    def specs(self) -> list[Spec]:
        """(name, dtype, shape) of every tensor, in order."""
        return [(t.name, t.dtype, t.shape) for t in self.tensors]

    def mismatch(self, other: "ModelLayout") -> str | None:
        """A sentence naming the first difference from ``other``, or None when they agree."""
        if len(self.tensors) != len(other.tensors):
            return f"expected {len(other.tensors)} tensors, got {len(self.tensors)}"
        for mine, theirs in zip(self.tensors, other.tensors):
            if (mine.name, mine.dtype, mine.shape) != (theirs.name, theirs.dtype, theirs.shape):
                return (f"tensor {theirs.name!r}: expected {theirs.dtype}{list(theirs.shape)}, "
                        f"got {mine.name!r} {mine.dtype}{list(mine.shape)}")
        return None

    def tensor_at(self, offset: int) -> int:
        """Index of the tensor holding byte ``offset`` (skipping empty tensors)."""
        return bisect.bisect_right(self._starts, offset) - 1

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelLayout) and self.specs() == other.specs()

    def __hash__(self) -> int:
        return hash(tuple(self.specs()))


def as_wire_array(array: np.ndarray) -> np.ndarray:
    """``array`` as a C-contiguous little-endian array of a wire dtype (copies only when needed)."""
    if array.dtype.name not in WIRE_DTYPES:
        raise CodecError(f"dtype {array.dtype} cannot be sent; use one of {', '.join(WIRE_DTYPES)}")
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return np.ascontiguousarray(array)


def iter_chunks(arrays: Sequence[np.ndarray], chunk_bytes: int) -> Iterator[tuple[int, bytes | memoryview]]:
    """Yield ``(offset, data)`` chunks of at most ``chunk_bytes`` covering the concatenated tensors.

    A chunk inside one tensor is a zero-copy view of it (valid while the array lives and is not modified);
    a chunk spanning tensors is joined into bytes.
    """
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    pending: list[memoryview] = []
    pending_len = 0
    offset = 0
    for array in arrays:
        array = as_wire_array(array)
        if array.nbytes == 0:
            continue
        view = memoryview(array.reshape(-1)).cast("B")
        pos = 0
        while pos < len(view):
            take = min(chunk_bytes - pending_len, len(view) - pos)
            pending.append(view[pos:pos + take])
            pending_len += take
            pos += take
            if pending_len == chunk_bytes:
                yield offset, b"".join(pending) if len(pending) > 1 else pending[0]
                offset += pending_len
                pending, pending_len = [], 0
    if pending_len:
        yield offset, b"".join(pending) if len(pending) > 1 else pending[0]


class TensorAssembler:
    """Receives a chunked tensor stream into preallocated arrays, validating as it goes."""

    def __init__(self, layout: ModelLayout, max_chunk_bytes: int):
        self.layout = layout
        self.max_chunk_bytes = max_chunk_bytes
        self.arrays = [np.empty(t.shape, dtype=np.dtype(t.dtype).newbyteorder("<")) for t in layout.tensors]
        self._views = [memoryview(a.reshape(-1)).cast("B") if a.nbytes else memoryview(b"") for a in self.arrays]
        self.received = 0
        self.chunks = 0

    def write(self, offset: int, data: bytes) -> None:
        """Copy one chunk into place; chunks must arrive in order and stay within the model."""
        if len(data) > self.max_chunk_bytes:
            raise CodecError(f"chunk of {len(data)} bytes exceeds the limit of {self.max_chunk_bytes}")
        if not data:
            raise CodecError("empty data chunk")
        if offset != self.received:
            raise CodecError(f"chunk at byte {offset}, expected byte {self.received} (chunks must be in order)")
        end = offset + len(data)
        if end > self.layout.total_bytes:
            raise CodecError(f"data runs past the end of the model ({end} > {self.layout.total_bytes} bytes)")
        src = memoryview(data)
        index = self.layout.tensor_at(offset)
        pos = offset
        while pos < end:
            meta = self.layout.tensors[index]
            start = pos - meta.offset
            take = min(meta.nbytes - start, end - pos)
            if take > 0:
                self._views[index][start:start + take] = src[pos - offset:pos - offset + take]
                pos += take
            index += 1
        self.received = end
        self.chunks += 1

    def fill(self, read_into) -> None:
        """Fill the whole model in one pass: ``read_into(view)`` must fill each tensor's byte view exactly
        (the data plane's recv_into); ``received`` counts only what was filled."""
        if self.received:
            raise CodecError("fill() needs an assembler that has received nothing yet")
        for meta, view in zip(self.layout.tensors, self._views):
            if meta.nbytes:
                read_into(view)
                self.received += meta.nbytes
        self.chunks += 1

    @property
    def complete(self) -> bool:
        """True once every byte of the model has arrived."""
        return self.received == self.layout.total_bytes

    def first_non_finite(self) -> str | None:
        """Name of the first floating tensor holding NaN or Inf, or None."""
        return first_non_finite(self.layout, self.arrays)


def first_non_finite(layout: ModelLayout, arrays: Sequence[np.ndarray]) -> str | None:
    """Name of the first floating tensor of ``arrays`` (in ``layout``) holding NaN or Inf, or None."""
    for meta, array in zip(layout.tensors, arrays):
        if meta.dtype in FLOAT_DTYPES and array.size and not np.isfinite(array).all():
            return meta.name
    return None


def wire_bytes(arrays: Sequence[np.ndarray]) -> bytes:
    """The tensors' bytes concatenated in order: what a whole chunked stream of ``arrays`` carries."""
    return b"".join(memoryview(as_wire_array(np.asarray(a)).reshape(-1)).cast("B") for a in arrays if np.size(a))


_DATA_FIELD = b"\x12"  # field 2, length-delimited: ModelChunk.data / UploadChunk.data / DataChunk.data
_OFFSET_FIELD = 0x08  # field 1, varint: DataChunk.offset


class RawData(NamedTuple):
    """A decoded data chunk: its byte offset in the model stream and a view of its payload."""

    offset: int
    data: memoryview


def encode_varint(value: int) -> bytes:
    """A non-negative integer as a protobuf base-128 varint."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    for i in range(pos, min(pos + 10, len(raw))):
        byte = raw[i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i + 1
        shift += 7
    raise ValueError("bad varint")


def encode_data_message(offset: int, data: bytes | memoryview) -> bytes:
    """The serialized ModelChunk/UploadChunk carrying ``data`` at ``offset`` (same bytes protobuf writes)."""
    inner_head = ((bytes([_OFFSET_FIELD]) + encode_varint(offset) if offset else b"")
                  + _DATA_FIELD + encode_varint(len(data)))
    return b"".join((_DATA_FIELD, encode_varint(len(inner_head) + len(data)), inner_head, data))


def decode_chunk_message(raw: bytes, message_type: type[Message]) -> RawData | Message:
    """A :class:`RawData` for a canonical data chunk, else ``message_type`` parsed from ``raw``."""
    if raw[:1] == _DATA_FIELD:
        try:
            length, pos = _read_varint(raw, 1)
            if pos + length == len(raw):
                offset = 0
                if raw[pos] == _OFFSET_FIELD:
                    offset, pos = _read_varint(raw, pos + 1)
                if raw[pos:pos + 1] == _DATA_FIELD:
                    size, pos = _read_varint(raw, pos + 1)
                    if pos + size == len(raw):
                        return RawData(offset, memoryview(raw)[pos:])
        except (ValueError, IndexError):
            pass
    return message_type.FromString(raw)


PROTOCOL_VERSION = 4  # 2: JoinPopulation carries its members as arrays; 3: a host's updates go on its HostUploadStream;
# 4: its long-polls go on its HostTaskStream
SERVICE_NAME = "fedpar.v1.Coordinator"
DEFAULT_CHUNK_BYTES = 1 << 20
# members registered by one JoinPopulation call: a host sends no more, a coordinator takes no more
MAX_POPULATION_JOIN = 10_000
# Room for the protobuf framing around one chunk's payload.
FRAMING_BYTES = 64 << 10
REPEATED_ENTRY_BYTES = 6  # beside an entry of a repeated field in a message under 64 MiB: its tag and length
# Initial metadata the coordinator sends on UploadUpdate once the upload holds a staging slot. Agents send
# the header, wait for it, and only then the data: an upload refused as busy costs no transfer and no
# coordinator memory (without the wait, every refused stream would have a flow-control window of data
# buffered in the coordinator's transport).
UPLOAD_ADMITTED = ("fedpar-upload", "admitted")
# Trailing metadata on a Join refused ALREADY_EXISTS: in how many seconds the session's holder, unheard since, loses
# its place. A process restarted at once after its earlier one was killed waits that long and joins, where it used
# to exit (a service manager restarting it would give up); a holder heard from again in the meantime is alive.
SESSION_FREE_IN = "fedpar-session-free-in"
# An update of fewer bytes is small, at both ends. The agent sends it whole without waiting for admission (a
# refused one costs less than the extra round trip), as one UploadSmall when it fits a chunk; the coordinator
# checks and folds it on its event loop (the hand-off to a thread would cost more: a 100-agent round of a
# small model is 100 of these).
SMALL_UPDATE_BYTES = 256 << 10
MAX_CLIENT_METRICS = 64  # metrics in one update's report
# A metric's largest magnitude: the round's example-weighted means (weights up to eval_examples, itself a metric)
# then stay finite, where one agent's 1e308 made every agent's train_loss of the round inf or NaN.
MAX_METRIC_MAGNITUDE = 1e100
MAX_SAID_CHARS = 500  # of a line a peer's words are logged in
# What a service's coordinator between runs says of an update it refuses (FAILED_PRECONDITION): its run ended, as
# a stopped run's agents' last uploads do; an agent that reads it says so calmly, not as a refusal.
NO_RUN_IN_PROGRESS = "no run is in progress"


def one_line(text: str, limit: int = MAX_SAID_CHARS) -> str:
    """What a peer said (a refusal's details, a shutdown reason, a tensor name in an error), as it may be logged: one
    line of at most ``limit`` printable characters (a hostile peer's newlines, terminal escapes or megabytes show as
    '?' or are cut, marked with '...')."""
    line = "".join(c if c.isprintable() else "?" for c in " ".join(text[:limit * 2].split()))
    return line if len(line) <= limit and len(text) <= limit * 2 else line[:limit - 3] + "..."


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
    ``local_epochs``), ``steps`` or ``metrics`` (at most MAX_CLIENT_METRICS values within MAX_METRIC_MAGNITUDE, names
    of 1..64 printable characters)."""
    max_examples = registered * local_epochs
    if not 1 <= num_examples <= max_examples:
        raise ValueError(f"num_examples={num_examples} must be in 1..{max_examples} "
                         f"({registered} registered examples x {local_epochs} epochs)")
    if steps < 0:
        raise ValueError("steps must be >= 0")
    if len(metrics) > MAX_CLIENT_METRICS:
        raise ValueError(f"{len(metrics)} metrics reported, at most {MAX_CLIENT_METRICS}")
    bad = next((k for k, v in metrics.items() if not _metric_ok(k, v)), None)
    if bad is not None:
        raise ValueError(f"metric {bad[:64]!r} = {metrics[bad]!r}: a metric must be named by 1..64 printable "
                         f"characters and be a number within +-{MAX_METRIC_MAGNITUDE:g}")


def _metric_ok(name: str, value: float) -> bool:
    """Whether one reported metric is a sane name (it becomes a metrics column) and a bounded number."""
    return 1 <= len(name) <= 64 and name.isprintable() and abs(value) <= MAX_METRIC_MAGNITUDE  # NaN fails too


# The report key of a client-side DP agent's clip bit: 1.0 when it clipped its update to dp_clip_norm, 0.0 when the
# update was within it (what DP-FedAvg counts for dp_clipped_fraction and adaptive clipping: aggregation/privacy.py).
DP_CLIPPED = "dp_clipped"


def reported_clip(metrics: Mapping[str, float]) -> bool | None:
    """The clip bit an update's report carries (None: none); a ValueError for a value other than 0 or 1."""
    value = metrics.get(DP_CLIPPED)
    if value is None:
        return None
    if value not in (0.0, 1.0):
        raise ValueError(f"the update's {DP_CLIPPED} report is {value!r}; it must be 1 (clipped) or 0 (within the "
                         "clip norm). The update was refused")
    return value == 1.0


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


def entries_within(texts: Iterable[str], room: int, beside: int = REPEATED_ENTRY_BYTES) -> int:
    """How many of ``texts``, in order, fit ``room`` bytes as entries of a repeated string field, ``beside`` bytes
    each besides its own (one at least, when there is one: a message must make progress)."""
    count = 0
    for text in texts:
        room -= len(text.encode()) + beside
        if room < 0 and count:
            break
        count += 1
    return count


def grpc_target(host: str, port: int) -> str:
    """``host:port`` as gRPC takes it: an IPv6 address in brackets (``[::1]:50051``; ``::1:50051`` failed to bind)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


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


def _parser(message_type: type[Message], decode: Callable[[bytes, type[Message]], object] | None = None
            ) -> Callable[[bytes], object]:
    """A reply deserializer for ``message_type`` (through ``decode`` when given) that returns None for bytes that do
    not parse: gRPC then ends the call INTERNAL, as when one raises, without logging the traceback it logs for a
    raise (a coordinator's garbage must cost the agent one line, never a traceback)."""
    def parse(raw: bytes) -> object:
        try:
            return decode(raw, message_type) if decode is not None else message_type.FromString(raw)
        except DecodeError as err:
            log.debug("a reply of %d bytes is not a %s: %s", len(raw), message_type.__name__, err)
            return None
    return parse


class CoordinatorStub:
    """Like the generated stub, but uploads may mix pre-encoded bytes with messages, and downloads
    yield :class:`~fedpar.protocol.codec.RawData` for data chunks."""

    def __init__(self, channel: grpc.Channel):
        def method(name: str) -> str:
            return f"/{SERVICE_NAME}/{name}"

        self.Join = channel.unary_unary(method("Join"), request_serializer=_serialize,
                                        response_deserializer=_parser(pb.JoinReply))
        self.PullTask = channel.unary_unary(method("PullTask"), request_serializer=_serialize,
                                            response_deserializer=_parser(pb.PullTaskReply))
        self.DownloadWeights = channel.unary_stream(
            method("DownloadWeights"), request_serializer=_serialize,
            response_deserializer=_parser(pb.ModelChunk, decode_chunk_message))
        self.UploadUpdate = channel.stream_unary(method("UploadUpdate"), request_serializer=_serialize,
                                                 response_deserializer=_parser(pb.UploadReply))
        self.UploadSmall = channel.unary_unary(method("UploadSmall"), request_serializer=_serialize,
                                               response_deserializer=_parser(pb.UploadReply))
        self.ReplyMessage = channel.unary_unary(method("ReplyMessage"), request_serializer=_serialize,
                                                response_deserializer=_parser(pb.UploadReply))
        self.Heartbeat = channel.unary_unary(method("Heartbeat"), request_serializer=_serialize,
                                             response_deserializer=_parser(pb.HeartbeatReply))
        self.Leave = channel.unary_unary(method("Leave"), request_serializer=_serialize,
                                         response_deserializer=_parser(pb.LeaveReply))
        self.JoinPopulation = channel.unary_unary(method("JoinPopulation"), request_serializer=_serialize,
                                                  response_deserializer=_parser(pb.JoinPopulationReply))
        self.HostTaskStream = channel.stream_stream(method("HostTaskStream"), request_serializer=_serialize,
                                                    response_deserializer=_parser(pb.PullHostTasksReply))
        self.HostUploadStream = channel.stream_stream(method("HostUploadStream"), request_serializer=_serialize,
                                                      response_deserializer=_parser(pb.HostUploadResults))
        self.SecAggExchange = channel.unary_unary(method("SecAggExchange"), request_serializer=_serialize,
                                                  response_deserializer=_parser(pb.SecAggReply))
