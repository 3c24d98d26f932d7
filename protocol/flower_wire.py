"""Flower Messages on fedpar's wire: serialized with Flower's own protobuf serde (flwr.common.serde), never
pickle, and checked on receipt (size, parse). Flower (flwr) is imported only by a run that uses a Flower App."""

from __future__ import annotations


class FlowerWireError(ValueError):
    """Bytes that are not a Flower Message this side may take (too large, or not parseable)."""


def encode_message(message) -> bytes:
    """``message`` (a flwr.app.Message) as bytes: Flower's serde to its protobuf, serialized."""
    from flwr.common.serde import message_to_proto

    return message_to_proto(message).SerializeToString(deterministic=True)


def decode_message(data: bytes, max_bytes: int):
    """The flwr.app.Message in ``data``, or FlowerWireError saying why it cannot be taken."""
    if len(data) > max_bytes:
        raise FlowerWireError(f"message of {len(data):,} bytes is over the limit of {max_bytes:,} "
                              "(--max-model-bytes)")
    from google.protobuf.message import DecodeError
    from flwr.common.serde import message_from_proto
    from flwr.proto.message_pb2 import Message as ProtoMessage

    try:
        return message_from_proto(ProtoMessage.FromString(data))
    except (DecodeError, ValueError, TypeError, KeyError, IndexError) as exc:
        raise FlowerWireError(f"not a Flower Message ({type(exc).__name__}: {exc})") from None
