"""gRPC servicer (asyncio): authenticates and validates every call, then hands it to the Coordinator."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import CodecError, TensorAssembler
from fedpar.protocol.messages import PROTOCOL_VERSION, SERVICE_NAME, UPLOAD_ADMITTED
from fedpar.protocol.rawchunks import RawData, decode_chunk_message
from fedpar.security.admission import AdmissionRefused
from fedpar.security.identity import peer_identity
from fedpar.server.coordinator import Coordinator
from fedpar.server.decoding import Malformed, parser, refuse_malformed
from fedpar.server.limits import Limits
from fedpar.server.registry import AgentRecord, AuthError
from fedpar.server.rounds import Refusal
from fedpar.server.secure_round import secagg_exchange

log = logging.getLogger("fedpar.server")
# Updates up to this size are scanned for NaN/Inf on the event loop: a thread hop would cost more.
INLINE_SCAN_BYTES = 256 << 10


class CoordinatorService:
    """Implements the Coordinator RPCs on top of a :class:`Coordinator`."""

    def __init__(self, coordinator: Coordinator):
        self.coord = coordinator
        self.limits = Limits(coordinator.config, coordinator.layout.total_bytes)

    def _auth(self, auth: pb.AgentAuth, context) -> AgentRecord:
        try:
            return self.coord.registry.authenticate(auth.agent_id, auth.token, peer_identity(context))
        except AuthError as exc:
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED, str(exc)) from None
        except AdmissionRefused as exc:
            raise Refusal(exc.code, exc.message) from None

    async def Join(self, request: pb.JoinRequest, context) -> pb.JoinReply:
        """Register an agent."""
        try:
            if request.protocol_version not in (0, PROTOCOL_VERSION):
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"protocol version {request.protocol_version} is not supported "
                              f"(coordinator speaks {PROTOCOL_VERSION}); upgrade the agent")
            self.limits.admit_join(request.agent_id, self.coord.registry)
            record = self.coord.join(request.agent_id, request.num_examples, dict(request.capabilities),
                                     peer_identity(context), request.enrollment_token)
        except Refusal as r:
            await context.abort(r.code, r.message)
        log.info("agent %s joined with %d examples", record.agent_id, record.num_examples)
        return pb.JoinReply(token=record.token, heartbeat_seconds=self.coord.config.heartbeat_seconds,
                            max_chunk_bytes=self.coord.config.max_chunk_bytes)

    async def PullTask(self, request: pb.PullTaskRequest, context) -> pb.PullTaskReply:
        """Long-poll for a task."""
        try:
            agent = self._auth(request.auth, context)
            with self.limits.agent_call(agent.agent_id):
                return await self.coord.next_task(agent, request.wait_seconds, request.finished_task_id)
        except Refusal as r:
            await context.abort(r.code, r.message)

    async def DownloadWeights(self, request: pb.DownloadRequest, context):
        """Stream the pre-serialized global weights of the agent's current round."""
        try:
            agent = self._auth(request.auth, context)
            payload = self.coord.payload_for(agent, request.round, request.task_id)
            with self.limits.agent_call(agent.agent_id):
                async with self.limits.download_slot():
                    for message in payload.messages():
                        yield message
            self.coord.download_completed(agent.agent_id, request.round, request.task_id)
        except Refusal as r:
            await context.abort(r.code, r.message)

    async def UploadUpdate(self, request_iterator, context) -> pb.UploadReply:
        """Receive one update: header, in-order data chunks, end marker; fold it only if all is valid."""
        try:
            first = await _next_message(request_iterator, self.coord.config.deadline_seconds)
            if first is None or isinstance(first, RawData) or first.WhichOneof("part") != "header":
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "an upload must start with an UploadHeader")
        except Refusal as r:
            await context.abort(r.code, r.message)

        async def receive(ticket) -> list:
            await context.send_initial_metadata((UPLOAD_ADMITTED,))  # the agent holds its data back until now
            return await self._receive(ticket, request_iterator)

        return await self._take_upload(first.header, context, receive)

    async def UploadSmall(self, request: pb.SmallUpload, context) -> pb.UploadReply:
        """Receive one small update in a single message, with every check UploadUpdate makes."""
        if not request.HasField("header"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a SmallUpload must carry its UploadHeader")
        return await self._take_upload(request.header, context,
                                       lambda ticket: self._assemble_small(ticket, request.data))

    async def _take_upload(self, header: pb.UploadHeader, context, receive) -> pb.UploadReply:
        """Admit an upload (identity, limits, header, staging slot), ``await receive(ticket)`` for its checked
        arrays and fold them; a refusal or a vanished agent leaves nothing of it in the round."""
        ticket = None
        try:
            agent = self._auth(header.auth, context)
            with self.limits.agent_call(agent.agent_id), self.limits.upload_queue():
                current = self.coord.current.round_id if self.coord.current else self.coord.round_id
                self.limits.start_upload(agent.agent_id, current)
                ticket = self.coord.open_upload(agent, header)
                async with self.coord.upload_slots():
                    arrays = await receive(ticket)
                    await self.coord.accept(ticket, arrays)
            return pb.UploadReply(accepted=True, message=f"update accepted for round {ticket.state.round_id}")
        except Refusal as r:
            if ticket is not None and r.final:
                self.coord.reject(ticket, r.message)
            elif ticket is not None:
                self.coord.abandon(ticket)
            await context.abort(r.code, r.message)
        except (asyncio.CancelledError, grpc.aio.AioRpcError, ConnectionError):
            # The agent went away mid-stream: nothing of this upload was applied.
            if ticket is not None:
                self.coord.abandon(ticket)
            raise

    async def _assemble_small(self, ticket, data: bytes) -> list:
        layout = ticket.layout
        if len(data) != layout.total_bytes:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"SmallUpload carries {len(data)} bytes but its tensors need {layout.total_bytes}; "
                          "the update was not applied", final=True)
        if layout.total_bytes > self.coord.config.max_chunk_bytes:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"an update of {layout.total_bytes} bytes is larger than one chunk "
                          f"({self.coord.config.max_chunk_bytes}); send it with UploadUpdate", final=True)
        assembler = TensorAssembler(layout, self.coord.config.max_chunk_bytes)
        if data:
            assembler.write(0, data)
        self.limits.count_bytes(ticket.slot.agent_id, len(data))
        return await self._checked_finite(assembler)

    async def _checked_finite(self, assembler: TensorAssembler) -> list:
        """The assembled arrays, refused if any holds NaN or Inf (large models are scanned off the loop)."""
        if assembler.layout.total_bytes <= INLINE_SCAN_BYTES:
            bad = assembler.first_non_finite()
        else:
            bad = await asyncio.get_running_loop().run_in_executor(None, assembler.first_non_finite)
        if bad is not None:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {bad!r} contains NaN or Inf; update refused",
                          final=True)
        return assembler.arrays

    async def _receive(self, ticket, request_iterator) -> list:
        layout = ticket.layout
        assembler = TensorAssembler(layout, self.coord.config.max_chunk_bytes)
        state = ticket.state
        while True:
            # A stalled stream must not hold its staging buffer past the round's deadline.
            remaining = state.started + state.deadline_seconds - time.monotonic()
            message = await _next_message(request_iterator, max(0.0, remaining))
            if message is None:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                              f"stream ended after {assembler.received} of {layout.total_bytes} bytes "
                              "without an UploadEnd; the update was not applied")
            ticket.state.check_open()
            if isinstance(message, RawData):
                kind, offset, data = "data", message.offset, message.data
            else:
                kind = message.WhichOneof("part")
                offset, data = message.data.offset, message.data.data
            if kind == "data":
                self.limits.count_chunk(assembler.chunks)
                try:
                    assembler.write(offset, data)
                except CodecError as exc:
                    raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"{exc}; the update was not applied",
                                  final=True) from None
                self.limits.count_bytes(ticket.slot.agent_id, len(data))
            elif kind == "end":
                if not assembler.complete or message.end.total_bytes != layout.total_bytes \
                        or message.end.num_chunks != assembler.chunks:
                    raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"UploadEnd after {assembler.received} of {layout.total_bytes} bytes in "
                                  f"{assembler.chunks} chunks does not match its totals "
                                  f"({message.end.total_bytes} bytes, {message.end.num_chunks} chunks)",
                                  final=True)
                break
            else:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected {kind or 'empty'} message in upload",
                              final=True)
        return await self._checked_finite(assembler)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatReply:
        """Mark the agent alive."""
        try:
            agent = self._auth(request.auth, context)
            with self.limits.agent_call(agent.agent_id):
                current = self.coord.current.round_id if self.coord.current else self.coord.round_id
        except Refusal as r:
            await context.abort(r.code, r.message)
        return pb.HeartbeatReply(current_round=current)

    async def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveReply:
        """Unregister the agent."""
        try:
            agent = self._auth(request.auth, context)
        except Refusal as r:
            await context.abort(r.code, r.message)
        self.coord.leave(agent)
        self.limits.forget(agent.agent_id)
        return pb.LeaveReply()

    async def SecAggExchange(self, request: pb.SecAggRequest, context) -> pb.SecAggReply:
        """One secure-aggregation stage message, answered by the server's next broadcast (long-poll)."""
        try:
            agent = self._auth(request.auth, context)
            with self.limits.agent_call(agent.agent_id):
                return await secagg_exchange(self.coord, agent.agent_id, request)
        except Refusal as r:
            await context.abort(r.code, r.message)


async def _next_message(request_iterator, timeout: float | None = None):
    try:
        message = await asyncio.wait_for(request_iterator.__anext__(), timeout)
    except StopAsyncIteration:
        return None
    except asyncio.TimeoutError:
        raise Refusal(grpc.StatusCode.DEADLINE_EXCEEDED,
                      "no upload data arrived before the round's deadline; the update was not applied") from None
    if isinstance(message, Malformed):
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"{message.reason}; the update was not applied")
    return message


def generic_handler(service: CoordinatorService) -> grpc.GenericRpcHandler:
    """Method handlers; downloads are sent as pre-serialized bytes (identity serializer)."""
    identity = lambda b: b  # noqa: E731 - download messages are serialized by WeightPayload
    handlers = {
        "Join": grpc.unary_unary_rpc_method_handler(
            refuse_malformed(service.Join), request_deserializer=parser(pb.JoinRequest),
            response_serializer=pb.JoinReply.SerializeToString),
        "PullTask": grpc.unary_unary_rpc_method_handler(
            refuse_malformed(service.PullTask), request_deserializer=parser(pb.PullTaskRequest),
            response_serializer=pb.PullTaskReply.SerializeToString),
        "DownloadWeights": grpc.unary_stream_rpc_method_handler(
            refuse_malformed(service.DownloadWeights), request_deserializer=parser(pb.DownloadRequest),
            response_serializer=identity),
        "UploadUpdate": grpc.stream_unary_rpc_method_handler(
            service.UploadUpdate,
            request_deserializer=parser(pb.UploadChunk, lambda raw: decode_chunk_message(raw, pb.UploadChunk)),
            response_serializer=pb.UploadReply.SerializeToString),
        "UploadSmall": grpc.unary_unary_rpc_method_handler(
            refuse_malformed(service.UploadSmall), request_deserializer=parser(pb.SmallUpload),
            response_serializer=pb.UploadReply.SerializeToString),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(
            refuse_malformed(service.Heartbeat), request_deserializer=parser(pb.HeartbeatRequest),
            response_serializer=pb.HeartbeatReply.SerializeToString),
        "Leave": grpc.unary_unary_rpc_method_handler(
            refuse_malformed(service.Leave), request_deserializer=parser(pb.LeaveRequest),
            response_serializer=pb.LeaveReply.SerializeToString),
        "SecAggExchange": grpc.unary_unary_rpc_method_handler(
            refuse_malformed(service.SecAggExchange), request_deserializer=parser(pb.SecAggRequest),
            response_serializer=pb.SecAggReply.SerializeToString),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
