"""Server-wide bound on gRPC calls in flight (``--max-concurrent-rpcs``), refused with a message naming it.

gRPC's own ``maximum_concurrent_rpcs`` answers "Concurrent RPC limit exceeded!", which does not tell an
operator which option to raise, so the count lives in :class:`Limits` and this interceptor applies it to
every method (long-polls and streams count for as long as they run).
"""

from __future__ import annotations

import grpc

from fedpar.server.limits import Limits
from fedpar.server.rounds import Refusal


class RpcLimit(grpc.aio.ServerInterceptor):
    """Wraps every method handler so that it holds one of ``limits``' concurrent-call places while it runs."""

    def __init__(self, limits: Limits):
        self.limits = limits

    async def intercept_service(self, continuation, handler_call_details):
        """The method's handler, counted."""
        handler = await continuation(handler_call_details)
        return None if handler is None else counted(handler, self.limits)


def counted(handler: grpc.RpcMethodHandler, limits: Limits) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour wrapped in :meth:`Limits.enter_rpc` / :meth:`Limits.exit_rpc`."""
    serde = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.response_streaming:
        make = grpc.stream_stream_rpc_method_handler if handler.request_streaming else \
            grpc.unary_stream_rpc_method_handler
        behavior = handler.stream_stream if handler.request_streaming else handler.unary_stream

        async def streaming(request, context):
            await _enter(limits, context)
            try:
                async for item in behavior(request, context):
                    yield item
            finally:
                limits.exit_rpc()
        return make(streaming, **serde)

    make = grpc.stream_unary_rpc_method_handler if handler.request_streaming else grpc.unary_unary_rpc_method_handler
    behavior = handler.stream_unary if handler.request_streaming else handler.unary_unary

    async def unary(request, context):
        await _enter(limits, context)
        try:
            return await behavior(request, context)
        finally:
            limits.exit_rpc()
    return make(unary, **serde)


async def _enter(limits: Limits, context) -> None:
    try:
        limits.enter_rpc()
    except Refusal as r:
        await context.abort(r.code, r.message)
