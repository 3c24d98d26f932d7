"""gRPC servicer (asyncio): authenticates and validates every call, then hands it to the Coordinator."""

from __future__ import annotations

import asyncio
import logging

import grpc

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import CodecError, TensorAssembler
from fedpar.protocol.messages import PROTOCOL_VERSION, SERVICE_NAME
from fedpar.protocol.rawchunks import RawData, decode_chunk_message
from fedpar.server.coordinator import Coordinator
from fedpar.server.registry import AgentRecord, AuthError
from fedpar.server.rounds import Refusal

log = logging.getLogger("fedpar.server")


class CoordinatorService:
    """Implements the Coordinator RPCs on top of a :class:`Coordinator`."""

    def __init__(self, coordinator: Coordinator):
        self.coord = coordinator

    def _auth(self, auth: pb.AgentAuth) -> AgentRecord:
        try:
            return self.coord.registry.authenticate(auth.agent_id, auth.token)
        except AuthError as exc:
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED, str(exc)) from None

    async def Join(self, request: pb.JoinRequest, context) -> pb.JoinReply:
        """Register an agent."""
        try:
            if request.protocol_version not in (0, PROTOCOL_VERSION):
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"protocol version {request.protocol_version} is not supported "
                              f"(coordinator speaks {PROTOCOL_VERSION}); upgrade the agent")
            record = self.coord.join(request.agent_id, request.num_examples, dict(request.capabilities))
        except Refusal as r:
            await context.abort(r.code, r.message)
        log.info("agent %s joined with %d examples", record.agent_id, record.num_examples)
        return pb.JoinReply(token=record.token, heartbeat_seconds=self.coord.config.heartbeat_seconds,
                            max_chunk_bytes=self.coord.config.max_chunk_bytes)

    async def PullTask(self, request: pb.PullTaskRequest, context) -> pb.PullTaskReply:
        """Long-poll for a task."""
        try:
            agent = self._auth(request.auth)
        except Refusal as r:
            await context.abort(r.code, r.message)
        return await self.coord.next_task(agent, request.wait_seconds)

    async def DownloadWeights(self, request: pb.DownloadRequest, context):
        """Stream the pre-serialized global weights of the agent's current round."""
        try:
            agent = self._auth(request.auth)
            payload = self.coord.payload_for(agent, request.round, request.task_id)
        except Refusal as r:
            await context.abort(r.code, r.message)
        for message in payload.messages:
            yield message

    async def UploadUpdate(self, request_iterator, context) -> pb.UploadReply:
        """Receive one update: header, in-order data chunks, end marker; fold it only if all is valid."""
        ticket = None
        try:
            first = await _next_message(request_iterator)
            if first is None or isinstance(first, RawData) or first.WhichOneof("part") != "header":
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "an upload must start with an UploadHeader")
            agent = self._auth(first.header.auth)
            ticket = self.coord.open_upload(agent, first.header)
            async with self.coord.upload_slots():
                arrays = await self._receive(ticket, request_iterator)
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

    async def _receive(self, ticket, request_iterator) -> list:
        layout = ticket.layout
        assembler = TensorAssembler(layout, self.coord.config.max_chunk_bytes)
        while True:
            message = await _next_message(request_iterator)
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
                try:
                    assembler.write(offset, data)
                except CodecError as exc:
                    raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"{exc}; the update was not applied",
                                  final=True) from None
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
        bad = await asyncio.get_running_loop().run_in_executor(None, assembler.first_non_finite)
        if bad is not None:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {bad!r} contains NaN or Inf; update refused",
                          final=True)
        return assembler.arrays

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatReply:
        """Mark the agent alive."""
        try:
            self._auth(request.auth)
        except Refusal as r:
            await context.abort(r.code, r.message)
        current = self.coord.current.round_id if self.coord.current else self.coord.round_id
        return pb.HeartbeatReply(current_round=current)

    async def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveReply:
        """Unregister the agent."""
        try:
            agent = self._auth(request.auth)
        except Refusal as r:
            await context.abort(r.code, r.message)
        self.coord.leave(agent)
        return pb.LeaveReply()


async def _next_message(request_iterator):
    try:
        return await request_iterator.__anext__()
    except StopAsyncIteration:
        return None


def generic_handler(service: CoordinatorService) -> grpc.GenericRpcHandler:
    """Method handlers; downloads are sent as pre-serialized bytes (identity serializer)."""
    identity = lambda b: b  # noqa: E731 - payload messages are serialized once per round
    handlers = {
        "Join": grpc.unary_unary_rpc_method_handler(
            service.Join, request_deserializer=pb.JoinRequest.FromString,
            response_serializer=pb.JoinReply.SerializeToString),
        "PullTask": grpc.unary_unary_rpc_method_handler(
            service.PullTask, request_deserializer=pb.PullTaskRequest.FromString,
            response_serializer=pb.PullTaskReply.SerializeToString),
        "DownloadWeights": grpc.unary_stream_rpc_method_handler(
            service.DownloadWeights, request_deserializer=pb.DownloadRequest.FromString,
            response_serializer=identity),
        "UploadUpdate": grpc.stream_unary_rpc_method_handler(
            service.UploadUpdate, request_deserializer=lambda raw: decode_chunk_message(raw, pb.UploadChunk),
            response_serializer=pb.UploadReply.SerializeToString),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(
            service.Heartbeat, request_deserializer=pb.HeartbeatRequest.FromString,
            response_serializer=pb.HeartbeatReply.SerializeToString),
        "Leave": grpc.unary_unary_rpc_method_handler(
            service.Leave, request_deserializer=pb.LeaveRequest.FromString,
            response_serializer=pb.LeaveReply.SerializeToString),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
