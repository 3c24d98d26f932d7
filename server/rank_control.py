"""The calls aggregator ranks make to rank 0 during a round: "count this upload", "this one was refused after all",
"this agent has its weights". Rank 0 alone decides which uploads count (first K, deadline, duplicates).

A small gRPC service of JSON messages on rank 0, apart from the agents' port and bound where the process group's
rendezvous is. Its callers are the other ranks of the group, which already trust each other (they share the
process group); each call carries a secret that rank 0 broadcasts over the group at start-up.
"""

from __future__ import annotations

import hmac
import json
import secrets
from typing import Awaitable, Callable

import grpc

from fedpar.server.rounds import Refusal

SERVICE = "fedpar.RankControl"
SECRET_HEADER = "x-fedpar-rank-secret"
Handler = Callable[[dict], Awaitable[dict] | dict]


def new_secret() -> str:
    """A fresh secret for one run of the group."""
    return secrets.token_urlsafe(24)


def _identity(data: bytes) -> bytes:
    return data


def control_handler(secret: str, handlers: dict[str, Handler]) -> grpc.GenericRpcHandler:
    """Rank 0's side: each method takes and returns a JSON object; a Refusal becomes its status and message."""

    def method(handler: Handler):
        async def call(request: bytes, context):
            sent = dict(context.invocation_metadata()).get(SECRET_HEADER, "")
            if not hmac.compare_digest(sent.encode(), secret.encode()):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not an aggregator rank of this coordinator")
            try:
                reply = handler(json.loads(request))
                if isinstance(reply, Awaitable):
                    reply = await reply
            except Refusal as r:
                await context.abort(r.code, r.message)
            return json.dumps(reply).encode()
        return grpc.unary_unary_rpc_method_handler(call, request_deserializer=_identity,
                                                   response_serializer=_identity)

    return grpc.method_handlers_generic_handler(SERVICE, {name: method(h) for name, h in handlers.items()})


class RankControlClient:
    """A rank's calls to rank 0 (on the rank's event loop); a refusal comes back as the same Refusal."""

    def __init__(self, target: str, secret: str, timeout_seconds: float):
        self.channel = grpc.aio.insecure_channel(target)
        self.metadata = ((SECRET_HEADER, secret),)
        self.timeout = timeout_seconds

    async def call(self, name: str, message: dict) -> dict:
        """Call ``name`` with ``message``; its reply, or the Refusal rank 0 answered with."""
        rpc = self.channel.unary_unary(f"/{SERVICE}/{name}", request_serializer=_identity,
                                       response_deserializer=_identity)
        try:
            reply = await rpc(json.dumps(message).encode(), metadata=self.metadata, timeout=self.timeout)
        except grpc.aio.AioRpcError as err:
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise Refusal(grpc.StatusCode.UNAVAILABLE, "the coordinator's rank 0 did not answer; the update was "
                              "not applied: send it again") from None
            raise Refusal(err.code(), err.details() or err.code().name) from None
        return json.loads(reply)

    async def close(self) -> None:
        """Close the channel."""
        await self.channel.close()
