"""The coordinator on the network: on the agents' gRPC port (its own, or a service's that outlives its runs:
server/agent_port.py) with the data plane beside it (:class:`CoordinatorServer`), and the servicer it runs
(:class:`CoordinatorService`), which decodes every call (malformed bytes get a clear INVALID_ARGUMENT, not an UNKNOWN
error), authenticates and validates it, then hands it to the Coordinator (uploads: to the upload intake,
server/uploads.py)."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import inspect
import logging
import ssl
import threading
from contextlib import nullcontext
from typing import Callable, NamedTuple

import grpc
from google.protobuf.message import DecodeError, Message

from fedpar.parallel.stopping import wait_awake
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import (PROTOCOL_VERSION, SERVICE_NAME, UPLOAD_ADMITTED, RawData, decode_chunk_message,
                                   grpc_target)
from fedpar.security.admission import AdmissionRefused
from fedpar.server.agent_port import AgentPort, BindError
from fedpar.server.coordinator import Coordinator
from fedpar.server.dataplane import start_data_plane
from fedpar.server.limits import Limits, StrangerBound, authenticated, call_identity, retrieved
from fedpar.server.members import TooFewMembers
from fedpar.server.populations import HOST_WAKEUP as HOST_CALLS
from fedpar.server.ranks.group import RankMissing
from fedpar.server.registry import AgentRecord, AuthError, HostRecord, SessionClaim
from fedpar.server.round_modes import take_host_partial
from fedpar.server.rounds import Refusal
from fedpar.server.secure_round import secagg_exchange
from fedpar.server.uploads import Upload, UploadIntake
from fedpar.task import TaskError

log = logging.getLogger("fedpar.server")
MAX_HOST_UPLOADS = 512  # updates in one HostUploads message (each at most one chunk: far below the message limit)
MAX_SESSION_TOKEN = 256  # characters of a session token a call presents (the registry's are 32)


class RestoreError(ValueError):
    """The coordinator's checkpoint cannot be restored (damaged, or of another model); the message says why."""


class CoordinatorServer:
    """Serves the coordinator on ``host:port`` (port 0 picks a free one) from a background thread; given
    ``agent_port``, on that port instead, stacked on the coordinators there (a service's: server/agent_port.py)."""

    def __init__(self, coordinator: Coordinator, host: str = "127.0.0.1", port: int = 0,
                 credentials: grpc.ServerCredentials | None = None, data_tls: ssl.SSLContext | None = None,
                 agent_port: AgentPort | None = None):
        self.coordinator = coordinator
        self.data_tls = data_tls  # TLS for the data plane; required for it when the port's credentials are set
        self._own_port = agent_port is None  # opened by start, closed by stop
        self.agent_port = agent_port or AgentPort(coordinator.config, coordinator.registry.admission, host, port,
                                                  credentials)
        self.data_plane = None
        self.error: BaseException | None = None
        self.on_listening: Callable[[int], None] | None = None  # called with the port once health checks answer
        self._ready = threading.Event()
        self._finished = threading.Event()
        self._running: concurrent.futures.Future | None = None
        self._stop: asyncio.Event | None = None
        self._stopped = False  # stop() ran: its coordinator is closed, so this server cannot start again
        self._grace = 1.0  # seconds calls in flight get when the server stops
        self._settle = False  # stop(settle=True): the rounds' ending is waited for past the grace

    @property
    def host(self) -> str:
        """The address the port listens on."""
        return self.agent_port.host

    @property
    def port(self) -> int | None:
        """The bound port (None until started)."""
        return self.agent_port.port

    @property
    def credentials(self) -> grpc.ServerCredentials | None:
        """The port's TLS credentials (None: plaintext)."""
        return self.agent_port.credentials

    @property
    def strangers(self) -> StrangerBound:
        """The port's calls not yet authenticated (for tests and logs)."""
        return self.agent_port.strangers

    @property
    def address(self) -> str:
        """``host:port`` agents should dial (RuntimeError before :meth:`start` binds the port)."""
        if self.port is None:
            raise RuntimeError("the coordinator server is not started, so it has no address yet: call start() "
                               "first (it binds the port)")
        return grpc_target(self.host, self.port)

    def start(self) -> int:
        """Start serving and running rounds; returns the bound port."""
        if self._stopped:
            raise RuntimeError("a stopped coordinator server cannot start again: build a new one with "
                               "CoordinatorAssembly.for_task(...).server(config, strategy) (its checkpoint_dir "
                               "resumes the run)")
        if self._running is not None:
            raise RuntimeError("the coordinator server is started already: start() once, then wait() or stop()")
        if self._own_port:
            self.agent_port.on_listening = self.on_listening
            try:
                self.agent_port.open()
            except BindError as exc:
                self.error = exc
                self._finished.set()
                raise
        self._running = self.agent_port.submit(self._main())
        wait_awake(self._ready)
        if self.error is not None:
            if self._own_port:
                self.agent_port.close(0)
            raise self.error
        atexit.register(self.stop)  # a program that ends without stop(): stopped while its loop still runs
        return self.port

    def wait(self, timeout: float | None = None) -> bool:
        """Block until all rounds are done (True) or ``timeout`` passes (False); re-raises round errors (RuntimeError
        before :meth:`start`)."""
        if self._running is None and not self._finished.is_set():
            raise RuntimeError("the coordinator server is not started, so there are no rounds to wait for: call "
                               "start() first")
        done = wait_awake(self._finished, timeout, stops=True)  # a stop leaves it: one CPython dropped is raised
        if self.error is not None:
            raise self.error
        return done

    def serve_to_end(self) -> None:
        """Start, serve until every round is done (re-raising a round error), then stop."""
        self.start()
        try:
            while not self.wait(0.5):
                pass
        finally:
            self.stop()

    def stop(self, grace: float = 1.0, settle: bool = False) -> None:
        """Stop the rounds and take the coordinator off its port (closing a port of its own); ``settle``: wait, past
        ``grace``, until the last finished round's row and checkpoint are written (or failed), so that what the run
        recorded last is all there is once this returns."""
        atexit.unregister(self.stop)
        self._stopped = True
        self._grace = grace
        self._settle = settle
        if self._running is not None and self._stop is not None:
            try:
                self.agent_port.on_loop(self._stop.set)
            except (RuntimeError, TimeoutError):
                pass  # the loop is gone already
            concurrent.futures.wait([self._running], timeout=None if settle else grace + 10)
        if self._own_port:
            self.agent_port.close(grace)
        self.coordinator.close()

    def on_loop(self, fn, timeout: float = 1.0):
        """``fn()`` run on the coordinator's event loop from another thread (its state belongs to the loop); raises
        RuntimeError when the loop is not running, TimeoutError when it does not answer in ``timeout`` s."""
        return self.agent_port.on_loop(fn, timeout)

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        service = CoordinatorService(self.coordinator)
        try:
            stacked = await self.agent_port.push(self.coordinator, generic_handler(service), service.limits)
        except BaseException as exc:  # start() re-raises it: it waited for _ready forever (a --port-file not written)
            self.error = exc
            self._ready.set()
            self._finished.set()
            raise
        try:
            try:  # the coordinator beneath answers meanwhile; with none, health checks do (NOT_SERVING)
                await asyncio.to_thread(self.coordinator.restore)
            except ValueError as exc:
                raise RestoreError(str(exc)) from exc
            self.data_plane = start_data_plane(self.coordinator, asyncio.get_running_loop(), self.host,
                                               self.credentials is not None, self.data_tls, service.intake)
            self.agent_port.restored(stacked)
            self._ready.set()
            await self._rounds()
        except BaseException as exc:  # surfaced to the caller through start()/wait()
            self.error = exc
            # Said in one line by the caller: a port, a checkpoint, a file that cannot be written (a full disk), or
            # a lost aggregator rank.
            if isinstance(exc, (TaskError, TooFewMembers)):  # said in one line by the command
                log.debug("coordinator stopped: %s", exc, exc_info=True)
            elif not isinstance(exc, (RestoreError, RankMissing, asyncio.CancelledError, GeneratorExit)) \
                    and not (isinstance(exc, OSError) and exc.errno):
                log.exception("coordinator stopped with an error")
        finally:
            if self.data_plane is not None:
                self.data_plane.stop()
            await self.agent_port.pop(stacked, self._grace)
            self._ready.set()
            self._finished.set()

    async def _rounds(self) -> None:
        """Run the rounds until they are done, then go on answering (agents hear "shutdown") until stopped."""
        rounds = asyncio.ensure_future(self.coordinator.run())
        stopper = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({rounds, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if rounds.done():
                if rounds.exception() is not None:
                    raise rounds.exception()
                self._finished.set()
                await stopper
        finally:
            rounds.cancel()
            stopper.cancel()
            # its own ending (a stopped run's last round written: a slow evaluation or checkpoint may take longer)
            await asyncio.wait({rounds}, timeout=None if self._settle else self._grace)


class CoordinatorService:
    """Implements the Coordinator RPCs on top of a :class:`Coordinator`."""

    def __init__(self, coordinator: Coordinator):
        self.coord = coordinator
        self.limits = Limits(coordinator.config, coordinator.layout.total_bytes)
        self.intake = UploadIntake(coordinator, self.limits)
        self._host_streams: dict[tuple[str, str], HostRecord] = {}  # (kind, host): the session whose stream is open

    def _auth(self, auth: pb.AgentAuth, context) -> AgentRecord:
        try:
            record = self.coord.registry.authenticate(auth.agent_id, auth.token, call_identity(context))
        except AuthError as exc:
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED, str(exc)) from None
        except AdmissionRefused as exc:
            raise Refusal(exc.code, exc.message) from None
        authenticated()  # an upload stream leaves the strangers' bounds for --max-concurrent-rpcs
        return record

    def _at_rank_0(self) -> None:
        """Refusal unless this is rank 0's port: agents and hosts join the coordinator, not another aggregator rank
        (whose plane keeps no members)."""
        if self.coord.rank:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this port is aggregator rank {self.coord.rank}'s, "
                          "which takes only the downloads and uploads "
                          "rank 0 deals to it; give --server the coordinator's --port (rank 0's)")

    async def Join(self, request: pb.JoinRequest, context) -> pb.JoinReply:
        """Register an agent."""
        self._at_rank_0()
        _check_protocol(request.protocol_version, "agent")
        claim = _session_claim(request, context)
        self.limits.admit_join(request.agent_id, self.coord.registry)
        record = self.coord.members.join(request.agent_id, request.num_examples, dict(request.capabilities),
                                         call_identity(context), request.enrollment_token, claim)
        log.info("agent %s joined with %d examples", record.agent_id, record.num_examples)
        return pb.JoinReply(token=record.token, heartbeat_seconds=self.coord.config.heartbeat_seconds,
                            max_chunk_bytes=self.coord.config.max_chunk_bytes)

    async def JoinPopulation(self, request: pb.JoinPopulationRequest, context) -> pb.JoinPopulationReply:
        """Register (more of) a simulation host's virtual population (each member's session derives from the
        host's: protocol/codec.py, member_token)."""
        self._at_rank_0()
        _check_protocol(request.protocol_version, "host")
        if not request.member_ids:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "a JoinPopulation must name its members in member_ids "
                                                            "(a host older than this coordinator? upgrade it)")
        claim = _session_claim(request, context)
        self.limits.admit_join(request.host.agent_id, self.coord.registry, len(request.num_examples))
        host = self.coord.members.join_population(
            request.host.agent_id, request.host.token, request.member_ids, request.num_examples, request.away,
            call_identity(context), request.enrollment_token, dict(request.capabilities), claim)
        authenticated()
        return pb.JoinPopulationReply(host_token=host.token,
                                      heartbeat_seconds=self.coord.config.heartbeat_seconds,
                                      max_chunk_bytes=self.coord.config.max_chunk_bytes)

    async def HostTaskStream(self, request_iterator, context):
        """A simulation host's long-polls for its sampled members' tasks, on one stream for the host's life (see
        :meth:`_host_stream`): each request answered by the tasks dealt to it, or none once its wait is over."""
        async for reply in self._host_stream(request_iterator, context, "a task stream", "PullHostTasksRequest",
                                             self._host_tasks):
            yield reply

    async def _host_tasks(self, host: HostRecord, request: pb.PullHostTasksRequest, context) -> pb.PullHostTasksReply:
        """One long-poll of ``host`` (authenticated): the tasks of its sampled members, its availability changes,
        finish estimates and failed tasks noted."""
        return await self.coord.members.next_host_tasks(host, request.wait_seconds, request.away, request.back,
                                                        request.finish_estimates, self.coord, request.failures,
                                                        request.availability_at)

    async def PullTask(self, request: pb.PullTaskRequest, context) -> pb.PullTaskReply:
        """Long-poll for a task."""
        agent = self._auth(request.auth, context)
        with self.limits.agent_call(agent.agent_id), self.coord.registry.long_polling(agent):
            try:
                return await self.coord.next_task(agent, request.wait_seconds, request.finished_task_id,
                                                  request.failure)
            except asyncio.CancelledError:  # its caller went away (an agent's process ends its long-poll)
                self.coord.registry.calls_cut(agent)
                raise

    async def DownloadWeights(self, request: pb.DownloadRequest, context):
        """Stream the pre-serialized global weights of the agent's current round."""
        agent = self._auth(request.auth, context)
        payload = self.coord.payload_for(agent, request.round, request.task_id)
        with self.limits.agent_call(agent.agent_id):
            async with self.limits.download_slot():
                for message in payload.messages():
                    yield message
        self.coord.download_completed(agent.agent_id, request.round, request.task_id)

    async def UploadUpdate(self, request_iterator, context) -> pb.UploadReply:
        """Receive one update: header, in-order data chunks, end marker; fold it only if all is valid."""
        # Nothing is authenticated before the header: a stream that does not send it at once is let go
        # (meanwhile it counts only against the strangers' bounds: server/limits.py).
        seconds = self.coord.config.upload_header_seconds
        first = await _next_message(request_iterator, seconds, lambda: Refusal(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"no UploadHeader within {seconds:g} s of opening the upload (--upload-header-seconds)"))
        if first is None or isinstance(first, RawData) or first.WhichOneof("part") != "header":
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "an upload must start with an UploadHeader")

        async def receive(upload: Upload) -> None:
            await context.send_initial_metadata((UPLOAD_ADMITTED,))  # the agent holds its data back until now
            await _receive_stream(upload, request_iterator)

        return await self._upload(first.header, context, receive)

    async def UploadSmall(self, request: pb.SmallUpload, context) -> pb.UploadReply:
        """Receive one small update in a single message, with every check UploadUpdate makes."""
        if not request.HasField("header"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a SmallUpload must carry its UploadHeader")
        return await self._upload(request.header, context, self.intake.small_receiver(request))

    async def HostUploadStream(self, request_iterator, context):
        """A simulation host's small updates, on one stream for the host's life (see :meth:`_host_stream`): each
        message (HostUploads) with one result per update: each authenticated with its member's session and taken with
        every check UploadSmall makes (a refusal is a result, not the stream's end), then a pre-summed partial of more
        members, with one result for all."""
        async for results in self._host_stream(request_iterator, context, "an upload stream", "HostUploads",
                                               self._host_uploads):
            yield results

    async def _host_stream(self, request_iterator, context, stream: str, what: str, answer):
        """The replies of a host's long-lived ``stream`` of ``what`` messages: its first message within
        --upload-header-seconds (a stranger's stream until then), then each message taken in order, its host
        authenticated again, and answered by ``await answer(host, message, context)``. A host has one stream of each
        kind open at a time (else it could hold --max-calls-per-agent idle ones), and the stream counts as one of its
        calls."""
        seconds = self.coord.config.upload_header_seconds
        request = await _next_message(request_iterator, seconds, lambda: Refusal(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"no {what} within {seconds:g} s of opening the stream (--upload-header-seconds)"))
        if request is None:
            return
        host = self._host(request.host, context)
        key = (what, host.host_id)
        if self._host_streams.get(key) is host:  # (one of a session the host replaced is its old process's: moot)
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"host {host.host_id!r} already has {stream} open; "
                                                              "send on it (one per host), or end it first")
        polling = self.coord.registry.long_polling(host) if what == "PullHostTasksRequest" else nullcontext()
        with self.limits.agent_call(HOST_CALLS + host.host_id), polling:
            self._host_streams[key] = host
            try:
                while request is not None:
                    if self.coord.handed_over:  # a service's next coordinator answers now: the host opens a new
                        return                  # stream, which reaches it, and sends this message again
                    if self._host(request.host, context).host_id != host.host_id:
                        raise Refusal(grpc.StatusCode.PERMISSION_DENIED, f"this stream is host {host.host_id!r}'s, "
                                                                         f"not {request.host.agent_id[:64]!r}'s")
                    yield await answer(host, request, context)
                    try:
                        request = await request_iterator.__anext__()
                    except StopAsyncIteration:
                        return
                    if isinstance(request, Malformed):
                        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                                      f"{request.reason}; the message was not taken")
            finally:
                if self._host_streams.get(key) is host:
                    del self._host_streams[key]
                if what == "PullHostTasksRequest":  # its task stream: a host's process keeps it open while it runs
                    self.coord.registry.calls_cut(host)

    async def _host_uploads(self, host: HostRecord, request: pb.HostUploads, context) -> pb.HostUploadResults:
        """Take ``host``'s (authenticated) HostUploads: its updates one by one, then its partial."""
        if len(request.uploads) > MAX_HOST_UPLOADS or len(request.failures) > MAX_HOST_UPLOADS:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"{len(request.uploads)} updates and "
                                                            f"{len(request.failures)} failures in one message; send "
                                                            f"at most {MAX_HOST_UPLOADS} of each")
        if request.failures:  # told at once, not with the host's next long-poll: the round stops waiting for them
            self._at_rank_0()
            self.coord.members.take_failures(host, request.failures, self.coord)
        results = pb.HostUploadResults()
        for item in request.uploads:
            try:
                if not item.HasField("header"):
                    raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "a SmallUpload must carry its UploadHeader")
                member = self._auth(item.header.auth, context)
                if member.host != host.host_id:
                    raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                                  f"{member.agent_id!r} is not a member of host {host.host_id!r}")
                reply = await self.intake.take(member, item.header, self.intake.small_receiver(item))
                results.results.add(accepted=reply.accepted, message=reply.message)
            except Refusal as r:
                results.results.add(message=r.message, code=r.code.value[0])
        if request.HasField("partial"):
            try:
                reply = await take_host_partial(self.coord, host.host_id, request.partial)
                results.partial.CopyFrom(pb.HostUploadResult(accepted=reply.accepted, message=reply.message))
            except Refusal as r:
                if self.coord.current is not None and r.code != grpc.StatusCode.UNIMPLEMENTED:
                    self.coord.current.note_refusal(r)
                results.partial.CopyFrom(pb.HostUploadResult(message=r.message, code=r.code.value[0]))
        return results

    def _host(self, auth: pb.AgentAuth, context) -> HostRecord:
        """The simulation host whose session ``auth`` is (over a connection its admission allows), or a Refusal."""
        try:
            host = self.coord.registry.authenticate_host(auth.agent_id, auth.token, call_identity(context))
        except AuthError as exc:
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED, str(exc)) from None
        except AdmissionRefused as exc:
            raise Refusal(exc.code, exc.message) from None
        authenticated()
        return host

    async def _upload(self, header: pb.UploadHeader, context, receive) -> pb.UploadReply:
        """Authenticate the uploading agent and hand the upload to the intake."""
        return await self.intake.take(self._auth(header.auth, context), header, receive)

    async def ReplyMessage(self, request: pb.MessageReply, context) -> pb.UploadReply:
        """A member's reply to the Flower Message of its task (a Flower App run: server/flower_rounds.py)."""
        agent = self._auth(request.auth, context)
        with self.limits.agent_call(agent.agent_id):
            self.limits.count_bytes(agent.agent_id, len(request.message))
            self.coord.take_reply(agent.agent_id, request)
        return pb.UploadReply(accepted=True)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatReply:
        """Mark the agent alive."""
        agent = self._auth(request.auth, context)
        with self.limits.agent_call(agent.agent_id):
            current = self.coord.current_round_id
        return pb.HeartbeatReply(current_round=current)

    async def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveReply:
        """Unregister the agent, or a simulation host with its members (its process is exiting)."""
        registry = self.coord.registry
        if registry.host(request.auth.agent_id) is not None and registry.get(request.auth.agent_id) is None:
            host = self._host(request.auth, context)
            self.coord.members.host_leaves(host)
            self.limits.forget(HOST_CALLS + host.host_id)
            return pb.LeaveReply()
        agent = self._auth(request.auth, context)
        self.coord.leave(agent)
        self.limits.forget(agent.agent_id)
        return pb.LeaveReply()

    async def SecAggExchange(self, request: pb.SecAggRequest, context) -> pb.SecAggReply:
        """One secure-aggregation stage message, answered by the server's next broadcast (long-poll)."""
        agent = self._auth(request.auth, context)
        with self.limits.agent_call(agent.agent_id):
            return await secagg_exchange(self.coord, agent.agent_id, request)


def _peer_address(context) -> str:
    """Where the running call comes from, as gRPC names its peer less the transport (``127.0.0.1:40312``)."""
    peer = context.peer() or ""
    kind, _, rest = peer.partition(":")
    return (rest if kind in ("ipv4", "ipv6") else peer)[:100]


def _session_claim(request: pb.JoinRequest | pb.JoinPopulationRequest, context) -> SessionClaim:
    """Who asks for a session at a Join (server/registry.py); a Refusal for a claim longer than any session token."""
    for name in ("replaces_token", "incarnation"):
        if len(getattr(request, name)) > MAX_SESSION_TOKEN:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"{name} has {len(getattr(request, name))} characters; "
                                                            f"at most {MAX_SESSION_TOKEN} are taken")
    return SessionClaim(request.replaces_token, request.incarnation, _peer_address(context))


def _check_protocol(version: int, who: str) -> None:
    """Refuse a peer speaking a protocol version this coordinator does not (0: unstated, taken as ours)."""
    if version not in (0, PROTOCOL_VERSION):
        older = who if version < PROTOCOL_VERSION else "coordinator"
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, f"protocol version {version} is not supported "
                                                           f"(coordinator speaks {PROTOCOL_VERSION}); "
                                                           f"upgrade the {older}")


async def _receive_stream(upload: Upload, request_iterator) -> None:
    """Stage an UploadUpdate stream's data chunks up to its UploadEnd, whose totals must match."""
    layout, staging, state, pace = upload.ticket.layout, upload.staging, upload.ticket.state, upload.pace
    while True:
        # A stalled or trickling stream must not hold its staging buffer (server/uploads.py).
        message = await _next_message(request_iterator, pace.next_wait(), pace.stalled, upload.overtaken)
        if message is None:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"stream ended after {staging.received} of {layout.total_bytes} bytes "
                          "without an UploadEnd; the update was not applied")
        state.check_open()
        if isinstance(message, RawData):
            upload.write(message.offset, message.data)
            continue
        kind = message.WhichOneof("part")
        if kind == "data":
            upload.write(message.data.offset, message.data.data)
        elif kind == "end":
            if not staging.complete or message.end.total_bytes != layout.total_bytes \
                    or message.end.num_chunks != staging.chunks:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                              f"UploadEnd after {staging.received} of {layout.total_bytes} bytes in "
                              f"{staging.chunks} chunks does not match its totals "
                              f"({message.end.total_bytes} bytes, {message.end.num_chunks} chunks)", final=True)
            return
        else:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected {kind or 'empty'} message in upload",
                          final=True)


async def _next_message(request_iterator, timeout: float, on_timeout: Callable[[], Refusal],
                        interrupted: asyncio.Future | None = None):
    """The stream's next message (None at its end); ``on_timeout()`` is raised if none comes in ``timeout`` s, or
    as soon as ``interrupted`` is done."""
    try:
        if interrupted is None:
            message = await asyncio.wait_for(request_iterator.__anext__(), timeout)
        else:
            coming = asyncio.ensure_future(request_iterator.__anext__())
            # if this call is cancelled (the agent went away), the read ends unread with the stream's end, and asyncio
            # would log that with a traceback
            coming.add_done_callback(retrieved)
            await asyncio.wait((coming, interrupted), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not coming.done():
                coming.cancel()
                raise asyncio.TimeoutError
            message = coming.result()
    except StopAsyncIteration:
        return None
    except asyncio.TimeoutError:
        raise on_timeout() from None
    if isinstance(message, Malformed):
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"{message.reason}; the update was not applied")
    return message


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


def answering_refusals(handler):
    """Wrap a handler (coroutine or async generator) so that a Malformed request and a Refusal raised anywhere in it
    abort the call with the refusal's status and message: the handlers only raise."""
    if inspect.isasyncgenfunction(handler):
        @functools.wraps(handler)
        async def stream(request, context):
            if isinstance(request, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            try:
                async for item in handler(request, context):
                    yield item
            except Refusal as r:
                await context.abort(r.code, r.message, r.trailing)
        return stream

    @functools.wraps(handler)
    async def unary(request, context):
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        try:
            return await handler(request, context)
        except Refusal as r:
            await context.abort(r.code, r.message, r.trailing)
    return unary


def generic_handler(service: CoordinatorService) -> grpc.GenericRpcHandler:
    """Method handlers; downloads are sent as pre-serialized bytes (identity serializer)."""
    identity = lambda b: b  # noqa: E731 - download messages are serialized by WeightPayload

    def unary(handler, request: type, reply: type):
        return grpc.unary_unary_rpc_method_handler(answering_refusals(handler), request_deserializer=parser(request),
                                                   response_serializer=reply.SerializeToString)
    handlers = {
        "Join": unary(service.Join, pb.JoinRequest, pb.JoinReply),
        "PullTask": unary(service.PullTask, pb.PullTaskRequest, pb.PullTaskReply),
        "JoinPopulation": unary(service.JoinPopulation, pb.JoinPopulationRequest, pb.JoinPopulationReply),
        "HostTaskStream": grpc.stream_stream_rpc_method_handler(
            answering_refusals(service.HostTaskStream), request_deserializer=parser(pb.PullHostTasksRequest),
            response_serializer=pb.PullHostTasksReply.SerializeToString),
        "DownloadWeights": grpc.unary_stream_rpc_method_handler(
            answering_refusals(service.DownloadWeights), request_deserializer=parser(pb.DownloadRequest),
            response_serializer=identity),
        "UploadUpdate": grpc.stream_unary_rpc_method_handler(
            answering_refusals(service.UploadUpdate),
            request_deserializer=parser(pb.UploadChunk, lambda raw: decode_chunk_message(raw, pb.UploadChunk)),
            response_serializer=pb.UploadReply.SerializeToString),
        "UploadSmall": unary(service.UploadSmall, pb.SmallUpload, pb.UploadReply),
        "HostUploadStream": grpc.stream_stream_rpc_method_handler(
            answering_refusals(service.HostUploadStream), request_deserializer=parser(pb.HostUploads),
            response_serializer=pb.HostUploadResults.SerializeToString),
        "ReplyMessage": unary(service.ReplyMessage, pb.MessageReply, pb.UploadReply),
        "Heartbeat": unary(service.Heartbeat, pb.HeartbeatRequest, pb.HeartbeatReply),
        "Leave": unary(service.Leave, pb.LeaveRequest, pb.LeaveReply),
        "SecAggExchange": unary(service.SecAggExchange, pb.SecAggRequest, pb.SecAggReply),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
