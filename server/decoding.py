"""Request decoding that turns malformed protobuf bytes into a clear INVALID_ARGUMENT, not an UNKNOWN error."""

from __future__ import annotations

import functools
import inspect
from typing import Callable, NamedTuple

import grpc
from google.protobuf.message import DecodeError, Message


class Malformed(NamedTuple):
    """Stands in for a request whose bytes did not parse."""

    reason: str


def parser(message_type: type[Message], decode: Callable[[bytes], object] | None = None) -> Callable[[bytes], object]:
    """A request deserializer that returns :class:`Malformed` instead of raising on bad bytes."""
    decode = decode or message_type.FromString

    def parse(raw: bytes) -> object:
        try:
            return decode(raw)
        except (DecodeError, ValueError, IndexError, TypeError) as exc:
            return Malformed(f"request is not a valid {message_type.DESCRIPTOR.full_name} ({exc})")
    return parse


def refuse_malformed(handler):
    """Wrap a unary-request handler (coroutine or async generator) to abort on a Malformed request."""
    if inspect.isasyncgenfunction(handler):
        @functools.wraps(handler)
        async def stream(request, context):
            if isinstance(request, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            async for item in handler(request, context):
                yield item
        return stream

    @functools.wraps(handler)
    async def unary(request, context):
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return await handler(request, context)
    return unary
