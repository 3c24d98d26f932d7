"""Tensor codec: raw little-endian buffers described by (name, dtype, shape) headers, streamed in chunks.

A model travels as the concatenation of its tensors' bytes, in order, with no padding. The sender cuts
that byte stream into chunks of at most ``chunk_bytes``; the receiver writes each chunk straight into
preallocated arrays (:class:`TensorAssembler`), checking order, bounds and size as it goes.

Each chunk travels in a data-chunk message, the only large messages fedpar sends, encoded by hand
(:func:`encode_data_message`, :func:`decode_chunk_message`). ``ModelChunk{data: DataChunk{offset, data}}`` and
``UploadChunk{data: ...}`` share one wire form (field 2 holding a DataChunk). Encoding it by hand writes the payload
once instead of through protobuf's arena, and decoding it hands out a zero-copy view of the payload. Anything not in
the canonical form falls back to the generated parser, so every valid encoding is still accepted.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Iterator, NamedTuple, Sequence

import numpy as np
from google.protobuf.message import Message

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
                raise CodecError(f"tensor {name!r}: dtype {dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
            shape = tuple(int(d) for d in shape)
            if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
                raise CodecError(f"tensor {name!r}: shape {shape} must have at most {MAX_DIMS} non-negative dims")
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
