"""Hand-coded protobuf encoding of data-chunk messages, the only large messages fedpar sends.

``ModelChunk{data: DataChunk{offset, data}}`` and ``UploadChunk{data: ...}`` share one wire form (field 2
holding a DataChunk). Encoding it by hand writes the payload once instead of through protobuf's
arena, and decoding it hands out a zero-copy view of the payload. Anything not in the canonical
form falls back to the generated parser, so every valid encoding is still accepted.
"""

from __future__ import annotations

from typing import NamedTuple

from google.protobuf.message import Message

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
