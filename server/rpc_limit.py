"""What every gRPC call passes before its handler runs: the revocation check, and the budget it is counted in.

- A client certificate that was revoked is refused at the first call, before anything is read or counted.
- Calls that send their request up front (unary requests) authenticate before they wait on anything, so they
  count against the honest budget, ``--max-concurrent-rpcs``, for as long as they run (long-polls included).
- A request stream (an upload) waits for its header before it can authenticate. Until then it counts only
  against the strangers' bounds (``--max-unauthenticated-calls`` in total, ``--max-unauthenticated-per-peer``
  per peer: its certificate's name, else its address), never the honest budget; beyond either bound the
  oldest such stream is let go (server/strangers.py). The handler calls :func:`authenticated` once the
  header's session checks out, which moves the call into the honest budget.

gRPC's own ``maximum_concurrent_rpcs`` answers "Concurrent RPC limit exceeded!", which does not tell an
operator which option to raise, so the counts live here and in :class:`Limits`.
"""

from __future__ import annotations

import asyncio
import contextvars

import grpc

from fedpar.security.admission import Admission, AdmissionRefused
from fedpar.security.identity import PeerIdentity, peer_identity
from fedpar.server.limits import Limits
from fedpar.server.rounds import Refusal
from fedpar.server.strangers import Stranger, StrangerBound


class CallBudget:
    """Which budget one call holds: the strangers' (until it authenticates) or the honest one."""

    def __init__(self, limits: Limits, stranger: Stranger | None = None):
        self.limits = limits
        self.stranger = stranger
        self.counted = False  # holds a --max-concurrent-rpcs place

    def enter(self) -> None:
        """Take a place in the honest budget (a Refusal naming --max-concurrent-rpcs when it is full)."""
        self.limits.enter_rpc()
        self.counted = True

    def authenticate(self) -> None:
        """The call proved who it is: leave the strangers' bounds for the honest budget."""
        stranger = self.stranger
        if stranger is None:
            return
        if stranger.evicted is not None:  # let go while its header was on the way
            raise stranger.evicted
        stranger.done()
        self.stranger = None
        self.enter()

    def release(self) -> None:
        """The call ended."""
        if self.stranger is not None:
            self.stranger.done()
        if self.counted:
            self.limits.exit_rpc()
            self.counted = False


_CALL: contextvars.ContextVar[CallBudget | None] = contextvars.ContextVar("fedpar_call_budget", default=None)


def authenticated() -> None:
    """Tell the running call's budget that it authenticated (no-op outside a counted call)."""
    budget = _CALL.get()
    if budget is not None:
        budget.authenticate()


def peer_key(context, identity: PeerIdentity | None) -> str:
    """Whom a call's strangers' bound is kept for: its certificate's name, else its address without the port."""
    if identity is not None:
        return f"certificate {identity.common_name!r}"
    peer = context.peer() or "unknown"
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rsplit(":", 1)[0].strip("[]")
    return peer


class RpcLimit(grpc.aio.ServerInterceptor):
    """Wraps every method handler in the revocation check and the budget it is counted in."""

    def __init__(self, limits: Limits, admission: Admission, strangers: StrangerBound):
        self.limits = limits
        self.admission = admission
        self.strangers = strangers

    async def intercept_service(self, continuation, handler_call_details):
        """The method's handler, checked and counted."""
        handler = await continuation(handler_call_details)
        return None if handler is None else self.counted(handler)

    async def _enter(self, context, streaming_request: bool) -> CallBudget:
        """The call's budget, or an abort: a revoked certificate, or a full budget."""
        identity = peer_identity(context)
        try:
            if identity is not None:
                self.admission.check_peer(identity)
            budget = CallBudget(self.limits)
            if streaming_request:
                task = asyncio.current_task()
                budget.stranger = self.strangers.admit(peer_key(context, identity), lambda _: task.cancel())
            else:
                budget.enter()
        except AdmissionRefused as exc:
            await context.abort(exc.code, exc.message)
        except Refusal as r:
            await context.abort(r.code, r.message)
        _CALL.set(budget)
        return budget

    def counted(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` with its behaviour run inside :meth:`_enter` and :meth:`CallBudget.release`."""
        serde = dict(request_deserializer=handler.request_deserializer,
                     response_serializer=handler.response_serializer)
        streams_in = handler.request_streaming
        if handler.response_streaming:
            make = grpc.stream_stream_rpc_method_handler if streams_in else grpc.unary_stream_rpc_method_handler
            behavior = handler.stream_stream if streams_in else handler.unary_stream

            async def streaming(request, context):
                budget = await self._enter(context, streams_in)
                try:
                    async for item in behavior(request, context):
                        yield item
                except asyncio.CancelledError:
                    await _evicted(budget, context)
                finally:
                    budget.release()
            return make(streaming, **serde)

        make = grpc.stream_unary_rpc_method_handler if streams_in else grpc.unary_unary_rpc_method_handler
        behavior = handler.stream_unary if streams_in else handler.unary_unary

        async def unary(request, context):
            budget = await self._enter(context, streams_in)
            try:
                return await behavior(request, context)
            except asyncio.CancelledError:
                await _evicted(budget, context)
            finally:
                budget.release()
        return make(unary, **serde)


async def _evicted(budget: CallBudget, context) -> None:
    """A cancelled call: abort with the strangers' bound that let it go, or let the cancellation go on."""
    stranger = budget.stranger
    if stranger is None or stranger.evicted is None:
        raise asyncio.CancelledError
    asyncio.current_task().uncancel()
    await context.abort(stranger.evicted.code, stranger.evicted.message)
