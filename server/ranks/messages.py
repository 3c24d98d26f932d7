"""The aggregator ranks' control messages (fedpar.proto: RankBroadcast and RankControl's) to and from bytes: one
codec for both channels. A message is taken whole or not at all: bytes that do not parse, a field missing, or a
field this version does not know are a RankMessageError that names the rank that sent it and the problem."""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

M = TypeVar("M", bound=Message)


class RankMessageError(ValueError):
    """A rank sent a control message this rank cannot take; the text names the sender and what is wrong."""


def encode(message: Message) -> bytes:
    """The bytes of a complete message (ValueError naming the missing field: a message built here is complete)."""
    problem = _problem(message)
    if problem:
        raise ValueError(f"a {message.DESCRIPTOR.name} {problem} was about to be sent")
    return message.SerializeToString()


def decode(kind: type[M], data: bytes, sender: str) -> M:
    """``data`` as a ``kind`` message from ``sender`` (e.g. "aggregator rank 2"); RankMessageError unless it parses
    and holds every field ``kind`` declares and none it does not."""
    name = kind.DESCRIPTOR.name
    try:
        message = kind.FromString(data)
    except (DecodeError, ValueError) as exc:
        raise RankMessageError(f"{sender} sent {len(data)} bytes that are not a {name} ({exc})") from None
    problem = _problem(message)
    if problem:
        raise RankMessageError(f"{sender} sent a {name} {problem}")
    return message


def _problem(message: Message, path: str = "") -> str:
    """What makes ``message`` incomplete or foreign ("" if nothing): a scalar field not set (each is declared
    ``optional`` so its presence shows), a oneof of messages with none set, a field number this version does not
    know; the same for every message inside it."""
    unknown = UnknownFieldSet(message)
    if len(unknown):
        where = f" in {path.rstrip('.')}" if path else ""
        return (f"with field number {unknown[0].field_number}{where}, which this fedpar does not know (run the same "
                "fedpar version on every rank)")
    fields = message.DESCRIPTOR.fields
    for field in fields:
        if field.message_type is None and not field.is_repeated and not message.HasField(field.name):
            return f"without its {path}{field.name}"
    for oneof in message.DESCRIPTOR.oneofs:
        if any(f.message_type is not None for f in oneof.fields) and message.WhichOneof(oneof.name) is None:
            return f"without a {path}{oneof.name}"
    for field in fields:
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue
        if field.is_repeated:
            inner = [(f"{path}{field.name}[{i}].", m) for i, m in enumerate(getattr(message, field.name))]
        else:
            inner = [(f"{path}{field.name}.", getattr(message, field.name))] if message.HasField(field.name) else []
        for where, m in inner:
            problem = _problem(m, where)
            if problem:
                return problem
    return ""


def serial_bytes(serial: int | None) -> bytes:
    """A certificate serial number as RankAgent.cert_serial carries it (big-endian; empty: none)."""
    return b"" if serial is None else serial.to_bytes(serial.bit_length() // 8 + 1, "big")


def serial_number(data: bytes) -> int | None:
    """The certificate serial number RankAgent.cert_serial carries (None: the agent joined without one)."""
    return int.from_bytes(data, "big") if data else None
