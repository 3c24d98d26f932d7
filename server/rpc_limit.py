"""What every gRPC call passes before its handler runs: the revocation check, and the budget it is counted in.

- A client certificate that was revoked is refused at the first call, before anything is read or counted.
- Every call starts as a stranger's: until it has sent its request (a unary call) or its upload header and
  session (an upload stream), it counts only against the strangers' bounds (``--max-unauthenticated-calls`` in
  total, ``--max-unauthenticated-per-peer`` per peer: its certificate's name, else its address), never the
  honest budget; beyond either bound the oldest such call is let go (server/strangers.py), and a call must send
  its request within ``--upload-header-seconds``. gRPC would hand a unary handler its request only once it
  arrived, holding a call whose request never comes uncounted and without limit, so unary methods are served
  here as one-message request streams (the same bytes on the wire). A unary call leaves the strangers' bounds
  when its request arrives (it authenticates before it waits on anything); an upload stream when the handler
  calls :func:`authenticated`. Both then count against ``--max-concurrent-rpcs`` for as long as they run.

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

    async def _enter(self, context) -> CallBudget:
        """The call's budget, a stranger's until it authenticates; or an abort: a revoked certificate, or a bound."""
        identity = peer_identity(context)
        try:
            if identity is not None:
                self.admission.check_peer(identity)
            budget = CallBudget(self.limits)
            task = asyncio.current_task()
            budget.stranger = self.strangers.admit(peer_key(context, identity), lambda _: task.cancel())
        except AdmissionRefused as exc:
            await context.abort(exc.code, exc.message)
        _CALL.set(budget)
        return budget

    async def _request(self, request_iterator, context, budget: CallBudget):
        """A unary call's one request, within --upload-header-seconds; it then leaves the strangers' bounds."""
        seconds = self.limits.config.upload_header_seconds
        try:
            request = await asyncio.wait_for(request_iterator.__anext__(), seconds)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no request within {seconds:g} s of opening the call (--upload-header-seconds)")
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without its request")
        try:
            budget.authenticate()
        except Refusal as r:
            await context.abort(r.code, r.message)
        return request

    def counted(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` served as a request stream inside :meth:`_enter` and :meth:`CallBudget.release`."""
        serde = dict(request_deserializer=handler.request_deserializer,
                     response_serializer=handler.response_serializer)
        streams_in = handler.request_streaming
        if handler.response_streaming:
            behavior = handler.stream_stream if streams_in else handler.unary_stream

            async def streaming(request_iterator, context):
                budget = await self._enter(context)
                try:
                    request = request_iterator if streams_in else await self._request(request_iterator, context,
                                                                                      budget)
                    async for item in behavior(request, context):
                        yield item
                except asyncio.CancelledError:
                    await _evicted(budget, context)
                finally:
                    budget.release()
            return grpc.stream_stream_rpc_method_handler(streaming, **serde)

        behavior = handler.stream_unary if streams_in else handler.unary_unary

        async def unary(request_iterator, context):
            budget = await self._enter(context)
            try:
                request = request_iterator if streams_in else await self._request(request_iterator, context, budget)
                return await behavior(request, context)
            except asyncio.CancelledError:
                await _evicted(budget, context)
            finally:
                budget.release()
        return grpc.stream_unary_rpc_method_handler(unary, **serde)


async def _evicted(budget: CallBudget, context) -> None:
    """A cancelled call: abort with the strangers' bound that let it go, or let the cancellation go on."""
    stranger = budget.stranger
    if stranger is None or stranger.evicted is None:
        raise asyncio.CancelledError
    asyncio.current_task().uncancel()
    await context.abort(stranger.evicted.code, stranger.evicted.message)
