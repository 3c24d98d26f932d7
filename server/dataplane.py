"""The coordinator's bulk data plane: serves downloads and receives uploads over plain (or TLS) sockets.

The wire format is in :mod:`fedpar.protocol.dataplane`. A new connection is a stranger until its TLS handshake,
ticket (and upload header) have arrived and the ticket checks out: that happens on the gate's threads, under
``--dataplane-handshake-seconds``, with strangers bounded per address and in total (server/limits.py: beyond
either bound the oldest is closed). Only then does the connection get one of the transfer threads, so no thread
that moves honest bytes ever waits on a stranger. Transfers use blocking sockets (sendall of the round's
contiguous payload; recv_into straight into the upload's staging arrays). The coordinator's event loop owns
all round state, so every check and state change (ticket claim, the upload intake's open, accept and settle:
server/uploads.py) runs on that loop through ``asyncio.run_coroutine_threadsafe``; only byte moving and the
NaN/Inf scan happen in these threads.

A connection presents a one-time ticket (:class:`TicketBook`): 256 random bits bound to an agent, a round and a task,
issued with the task. A ticket allows one download and one upload, each at most once to completion and one
connection at a time; an operation that broke off gives its use back (the agent may retry this round, as after a
broken gRPC stream). Tickets expire with their round. The book is mutated only on the coordinator's loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import select
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import FRAMING_BYTES
from fedpar.protocol.dataplane import (OK, OP_DOWNLOAD, OP_UPLOAD, PREAMBLE, TICKET_BYTES, DataPlaneError, Deadline,
                                       decode_preamble, encode_status, read_frame, recv_exact, recv_exact_into, refusal,
                                       send_all)
from fedpar.security.admission import AdmissionRefused, PeerIdentity
from fedpar.server.limits import Limits, Stranger, StrangerBound
from fedpar.server.registry import AuthError
from fedpar.server.rounds import Refusal
from fedpar.server.uploads import RATE_GRACE_SECONDS, Upload, UploadIntake

log = logging.getLogger("fedpar.server.dataplane")
LOOP_CALL_SECONDS = 60.0
ACCEPT_RETRY_SECONDS = 0.1  # after a failed accept (no file descriptor to be had), instead of spinning a core
# Upload bytes are read, counted (--max-upload-bytes-per-second) and paced (UploadPace) in pieces of this size.
RECV_PIECE = 1 << 20
# Download bytes are sent in pieces of this size, each within the upload's idle limit plus its time at the minimum
# rate, so a reader that stops reading frees its transfer thread in seconds, not at the round's deadline.
SEND_PIECE = 64 << 10
OP_NAMES = {OP_DOWNLOAD: "download"}


@dataclass
class TransferTicket:
    """What a ticket grants, and which of its operations are in progress or done."""

    agent_id: str
    round_id: int
    task_id: str
    holder: str = ""  # whose client certificate may present it: the agent's own, or its simulation host's
    ops: dict[int, str] = field(default_factory=dict)  # op -> "busy" | "used"

    def __post_init__(self) -> None:
        self.holder = self.holder or self.agent_id


class TicketBook:
    """Issues tickets with the tasks of a round and checks them when a data connection presents one."""

    def __init__(self):
        self._live: dict[bytes, TransferTicket] = {}
        self._expired: dict[bytes, int] = {}  # tickets of the previous round, for a clear refusal

    def issue(self, agent_id: str, round_id: int, task_id: str, holder: str = "") -> bytes:
        """A fresh ticket for ``agent_id``'s task in ``round_id`` (``holder``: whose certificate speaks for it,
        if not its own)."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        self.admit(ticket, agent_id, round_id, task_id, holder)
        return ticket

    def admit(self, ticket: bytes, agent_id: str, round_id: int, task_id: str, holder: str = "") -> None:
        """Honour ``ticket``, drawn elsewhere (by rank 0 for an agent dealt to this aggregator rank)."""
        if len(ticket) != TICKET_BYTES:
            raise ValueError(f"a data-plane ticket has {TICKET_BYTES} bytes, not {len(ticket)}")
        self._live[ticket] = TransferTicket(agent_id, round_id, task_id, holder)

    def expire_rounds_before(self, round_id: int) -> None:
        """Tickets of earlier rounds stop working (called when ``round_id`` starts)."""
        old = {t: e.round_id for t, e in self._live.items() if e.round_id < round_id}
        self._expired = old
        for t in old:
            del self._live[t]

    def claim(self, ticket: bytes, op: int, current_round: int | None, round_open: bool,
              peer_agent: str | None) -> TransferTicket:
        """Mark ``op`` of ``ticket`` busy, or raise Refusal saying why the ticket cannot be used."""
        entry = self._live.get(ticket)
        if entry is None:
            if ticket in self._expired:
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"data-plane ticket of round {self._expired[ticket]} has expired; pull a new task")
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED, "unknown data-plane ticket; pull a new task")
        if peer_agent is not None and peer_agent != entry.holder:
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                          f"this data-plane ticket was issued to agent {entry.holder!r}, but the client "
                          f"certificate proves {peer_agent!r}")
        if entry.round_id != current_round or not round_open:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"data-plane ticket of round {entry.round_id} has expired (the round is closed); "
                          "the update was not applied")
        name = OP_NAMES.get(op, "upload")
        state = entry.ops.get(op)
        if state == "used":
            raise Refusal(grpc.StatusCode.ALREADY_EXISTS,
                          f"data-plane ticket already used for the {name} of round {entry.round_id}")
        if state == "busy":
            raise Refusal(grpc.StatusCode.ALREADY_EXISTS,
                          f"data-plane ticket is already in use by another {name} connection")
        entry.ops[op] = "busy"
        return entry

    def release(self, entry: TransferTicket, op: int, used: bool) -> None:
        """End an operation: ``used`` spends it; otherwise (it broke off) it may be tried again."""
        if used:
            entry.ops[op] = "used"
        else:
            entry.ops.pop(op, None)


class DataPlaneServer:
    """Listens on ``host:port`` (0: a free port) and moves weights for ticket holders."""

    def __init__(self, coordinator, loop: asyncio.AbstractEventLoop, host: str, port: int = 0,
                 ssl_context: ssl.SSLContext | None = None, intake: UploadIntake | None = None):
        self.coord = coordinator
        self.loop = loop
        self.ssl_context = ssl_context
        config = coordinator.config
        # The gRPC service's intake (and so its limits), when serving beside it.
        self.intake = intake or UploadIntake(coordinator, Limits(config, coordinator.layout.total_bytes))
        self.limits = self.intake.limits
        self.handshake_seconds = config.dataplane_handshake_seconds
        self.strangers = StrangerBound(config.max_dataplane_handshakes, config.max_dataplane_handshakes_per_peer,
                                       "--max-dataplane-handshakes", "--max-dataplane-handshakes-per-peer",
                                       "data-plane connections")
        self.workers = config.max_concurrent_uploads + config.data_plane_downloads
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="fedpar-data")  # authenticated only
        self._listener = socket.create_server((host, port), backlog=1024)
        self._listener.settimeout(0.5)
        self.port = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        self._active: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.downloads = 0  # completed data-plane downloads and accepted uploads (for tests and logs)
        self.uploads = 0
        self._thread = threading.Thread(target=self._accept_loop, name="fedpar-data-accept", daemon=True)

    def start(self) -> int:
        """Start accepting; returns the bound port."""
        self._thread.start()
        return self.port

    def stop(self) -> None:
        """Stop accepting and break off transfers in progress (never blocks the event loop)."""
        self._stopped.set()
        self._listener.close()
        with self._lock:
            for sock in self._active:
                _shut(sock, socket.SHUT_RDWR)
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def busy(self) -> bool:
        """Whether any connection is still open (for tests)."""
        return bool(self._active)

    # ----------------------------------------------------------------- connections
    def _accept_loop(self) -> None:
        late = Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, f"no data-plane ticket within {self.handshake_seconds:g} s "
                                                          "of connecting (--dataplane-handshake-seconds)")
        failing: OSError | None = None
        while not self._stopped.is_set():
            self.strangers.expire(self.handshake_seconds, late)  # however slowly a handshake trickles in
            try:
                sock, address = self._listener.accept()
            except socket.timeout:
                continue
            except OSError as exc:  # e.g. out of file descriptors: accept fails at once until one is freed
                if failing is None and not self._stopped.is_set():
                    log.warning("data plane cannot accept connections: %s; retrying every %g s", exc,
                                ACCEPT_RETRY_SECONDS)
                failing = exc
                self._stopped.wait(ACCEPT_RETRY_SECONDS)
                continue
            if failing is not None:
                log.warning("data plane accepts connections again")
                failing = None
            if self.ssl_context is not None:  # no I/O yet: the handshake happens on a gate thread
                sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            with self._lock:
                self._active.add(sock)
            # A stranger until authenticated; beyond the bounds the oldest stranger is woken up and closed.
            stranger = self.strangers.admit(address[0], functools.partial(_wake, sock),
                                            functools.partial(_quiet, sock))
            # One short-lived thread each (the bound above caps them), so none waits in a queue behind strangers.
            try:
                threading.Thread(target=self._admit, args=(sock, stranger), name="fedpar-data-gate",
                                 daemon=True).start()
            except RuntimeError:  # no thread to be had: this one is closed, the next may find one
                stranger.done()
                self._close(sock)

    def _admit(self, sock: socket.socket, stranger: Stranger) -> None:
        """Gate thread: handshake, ticket and upload header under the short deadline, checked on the loop; an
        authenticated connection then goes to a transfer thread, anything else is refused and closed."""
        job = None
        try:
            job = self._authenticate(sock, stranger)
        except Refusal as r:
            _send_refusal(sock, r)
        except (DataPlaneError, ssl.SSLError, OSError) as exc:
            if time.monotonic() >= stranger.started + self.handshake_seconds and stranger.evicted is None:
                stranger.evicted = Refusal(grpc.StatusCode.DEADLINE_EXCEEDED,
                                           f"no data-plane ticket within {self.handshake_seconds:g} s of "
                                           "connecting (--dataplane-handshake-seconds)")
            if stranger.evicted is not None and (not isinstance(sock, ssl.SSLSocket) or sock.version()):
                _send_refusal(sock, stranger.evicted)  # only past the TLS handshake (or without TLS)
            log.info("data connection dropped before it authenticated: %s",
                     stranger.evicted.message if stranger.evicted is not None else exc)
        except Exception:  # never let one connection take a thread down silently
            log.exception("data connection failed")
        finally:
            stranger.done()
        if job is None:
            self._close(sock)
            return
        try:
            self._pool.submit(self._transfer, sock, job)
        except RuntimeError:  # the pool shut down: let the job release what it holds
            self._transfer(sock, job)

    def _authenticate(self, sock: socket.socket, stranger: Stranger):
        """The transfer an authenticated connection asked for, as a callable taking the socket."""
        early = Deadline(self.handshake_seconds)
        early.arm(sock)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = None
        if self.ssl_context is not None:
            sock.do_handshake()
            peer = _peer_identity(sock)
            if peer is not None:  # a revoked certificate goes no further than its handshake
                try:
                    self.coord.registry.admission.check_peer(peer)
                except AdmissionRefused as exc:
                    raise Refusal(exc.code, exc.message) from None
        op, ticket = decode_preamble(recv_exact(sock, PREAMBLE.size, early))
        # It has presented a ticket, which the loop checks at once: no more waiting on it, so it may not be let go.
        stranger.done()
        if op == OP_DOWNLOAD:
            return functools.partial(self._download, *self._on_loop(self._claim_download, ticket, peer))
        entry, _, deadline_at = self._on_loop(self._claim, ticket, OP_UPLOAD, peer)
        try:
            try:
                limit = self.coord.config.max_chunk_bytes + FRAMING_BYTES  # the gRPC path's message limit
                header = pb.UploadHeader.FromString(read_frame(sock, early, limit))
            except (DataPlaneError, DecodeError) as exc:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"bad upload header: {exc}") from None
            claimed = self._on_loop(self._open_upload, entry, deadline_at, peer, header)
        except BaseException:
            self._on_loop(self.coord.tickets.release, entry, OP_UPLOAD, False)
            raise
        return functools.partial(self._upload, *claimed)

    def _transfer(self, sock: socket.socket, job) -> None:
        """Transfer thread: run an authenticated connection's download or upload, then close it."""
        try:
            job(sock)
        except (DataPlaneError, ssl.SSLError, OSError) as exc:
            log.info("data connection dropped: %s", exc)
        except Exception:  # never let one connection take a worker down silently
            log.exception("data connection failed")
        finally:
            self._close(sock)

    def _close(self, sock: socket.socket) -> None:
        with self._lock:
            self._active.discard(sock)
        try:
            sock.close()
        except OSError:
            pass

    def _on_loop(self, fn, *args):
        """Run ``fn(*args)`` on the coordinator's loop (a coroutine function is awaited) and return its result."""
        async def call():
            result = fn(*args)
            return await result if asyncio.iscoroutine(result) else result
        if self._stopped.is_set():
            raise DataPlaneError("the coordinator is shutting down")
        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(LOOP_CALL_SECONDS)

    # ----------------------------------------------------------------- download
    def _download(self, entry, payload, deadline_at: float, held: ExitStack, sock: socket.socket) -> None:
        """Send the round's weights to a connection whose ticket was claimed (:meth:`_claim_download`)."""
        done = False
        try:
            deadline = Deadline(deadline_at - time.monotonic())
            send_all(sock, encode_status(OK, payload.model_header), deadline)
            self._send_paced(sock, payload.flat, deadline)
            done = True
            self.downloads += 1
        finally:
            self._on_loop(self._release_download, entry, done, held)

    def _send_paced(self, sock: socket.socket, data: memoryview, deadline: Deadline) -> None:
        """Send ``data`` as an upload must arrive: no piece stalls past --upload-idle-seconds (plus its time at
        --upload-min-bytes-per-second), and from RATE_GRACE_SECONDS on the average keeps that rate."""
        config = self.coord.config
        idle, rate = config.upload_idle_seconds, config.upload_min_bytes_per_second
        started = time.monotonic()
        for start in range(0, len(data), SEND_PIECE):
            piece = data[start:start + SEND_PIECE]
            allowed = idle + (len(piece) / rate if rate else 0.0)
            send_all(sock, piece, Deadline(min(allowed, deadline.at - time.monotonic())))
            elapsed = time.monotonic() - started
            if elapsed > min(idle, RATE_GRACE_SECONDS) and start + len(piece) < rate * elapsed:
                raise DataPlaneError(f"the agent read its download slower than {rate:.0f} bytes/s "
                                     "(--upload-min-bytes-per-second); dropped")

    def _release_download(self, entry, done: bool, held: ExitStack) -> None:
        held.close()
        self.coord.tickets.release(entry, OP_DOWNLOAD, done)
        if done:
            self.coord.download_completed(entry.agent_id, entry.round_id, entry.task_id)

    def _claim(self, ticket: bytes, op: int, peer: PeerIdentity | None):
        """Check a ticket and its holder (loop thread); returns (entry, agent record, round deadline)."""
        coord = self.coord
        state = coord.current
        entry = coord.tickets.claim(ticket, op, state.round_id if state else None,
                                    state is not None and not state.closed, peer and peer.common_name)
        try:
            agent = coord.registry.get(entry.agent_id)
            if agent is None:
                raise Refusal(grpc.StatusCode.UNAUTHENTICATED,
                              f"agent {entry.agent_id!r} is not registered; join again")
            try:
                coord.registry.admission.check_call(entry.holder, peer)
            except AdmissionRefused as exc:
                raise Refusal(exc.code, exc.message) from None
            agent.last_seen = time.monotonic()
        except Refusal:
            coord.tickets.release(entry, op, False)
            raise
        return entry, agent, state.closes_at

    def _claim_download(self, ticket: bytes, peer: PeerIdentity | None):
        entry, agent, deadline_at = self._claim(ticket, OP_DOWNLOAD, peer)
        held = ExitStack()  # as on gRPC, a download in progress is one of its agent's calls
        try:
            payload = self.coord.payload_for(agent, entry.round_id, entry.task_id)
            if payload.flat is None:
                raise Refusal(grpc.StatusCode.UNAVAILABLE, "weights for the data plane are not ready; use gRPC")
            held.enter_context(self.limits.agent_call(agent.agent_id))
        except Refusal:
            held.close()
            self.coord.tickets.release(entry, OP_DOWNLOAD, False)
            raise
        return entry, payload, deadline_at, held

    # ----------------------------------------------------------------- upload
    def _upload(self, entry, upload: Upload, deadline_at: float, sock: socket.socket) -> None:
        """Receive an opened upload (:meth:`_open_upload`) for the intake: its checks and state changes run on the
        loop, bytes move here."""
        deadline = Deadline(deadline_at - time.monotonic())
        hold = None
        refused: Refusal | None = None
        received = [0]  # bytes read, in whole RECV_PIECEs: the rest of the advance charge is refunded

        def read_into(view: memoryview) -> None:
            for start in range(0, len(view), RECV_PIECE):
                piece = view[start:start + RECV_PIECE]
                allowed = upload.pace.next_wait(len(piece))  # the idle limit plus its time at the minimum rate
                begun = time.monotonic()
                try:
                    recv_exact_into(sock, piece, Deadline(allowed), upload.pace.note)
                except DataPlaneError:
                    now = time.monotonic()  # out of pace before the round's deadline: say so; else drop as before
                    if upload.pace.preempted:  # its slot went to a waiting upload: reading was stopped
                        raise upload.pace.overtaken() from None
                    if now - begun >= allowed - 0.05 and now < upload.pace.deadline_at - 0.05:
                        raise upload.pace.stalled() from None
                    raise
                received[0] += len(piece)
        try:
            left = deadline_at - time.monotonic()
            try:
                hold = asyncio.run_coroutine_threadsafe(
                    self.intake.reserve_staging(upload, functools.partial(_stop_reading, sock), left),
                    self.loop).result(left + 5)
            except Exception:
                raise DataPlaneError("no upload slot became free before the round deadline") from None
            send_all(sock, encode_status(OK), deadline)
            upload.staging.fill(read_into)
            reply = self._on_loop(upload.accept, upload.finite_arrays())
            self.uploads += 1
            send_all(sock, encode_status(OK, reply.SerializeToString()), deadline)
        except Refusal as r:
            refused = r
            _send_refusal(sock, r)
        finally:
            if hold is not None:
                self.loop.call_soon_threadsafe(self.intake.release_staging, hold)
            try:
                self._on_loop(self._settle_upload, entry, upload, refused, received[0])
            except (DataPlaneError, RuntimeError, TimeoutError) as exc:
                log.warning("could not record the end of a data-plane upload: %s", exc)
            refused = None  # its traceback holds this frame: no cycle through it (server/uploads.py says why)

    def _open_upload(self, entry, deadline_at: float, peer: PeerIdentity | None, header: pb.UploadHeader):
        """Check that the header's session is the claimed ticket's holder's, and open the upload (loop); the
        caller releases the ticket on a refusal."""
        try:  # the upload header carries the session like on gRPC: ticket and session must agree
            agent = self.coord.registry.authenticate(header.auth.agent_id, header.auth.token, peer)
        except AuthError as exc:
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED, str(exc)) from None
        except AdmissionRefused as exc:
            raise Refusal(exc.code, exc.message) from None
        if agent.agent_id != entry.agent_id:
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                          f"this data-plane ticket was issued to agent {entry.agent_id!r}, not to {agent.agent_id!r}")
        upload = self.intake.open(agent, header, issued=(entry.round_id, entry.task_id), prepaid=True)
        return entry, upload, deadline_at

    def _settle_upload(self, entry, upload: Upload, refused: Refusal | None, received: int) -> None:
        self.intake.settle(upload, refused, received)
        self.coord.tickets.release(entry, OP_UPLOAD, upload.ticket.slot.status != "pending")


def _shut(sock: socket.socket, how: int) -> None:
    """Wake whatever blocks on ``sock`` (the plain socket call: a TLS socket may be mid-handshake)."""
    try:
        socket.socket.shutdown(sock, how)
    except OSError:
        pass


def _wake(sock: socket.socket, _: Refusal) -> None:
    """Let a stranger go: its gate thread wakes up to an end of input (and may still send it the refusal)."""
    _shut(sock, socket.SHUT_RD)


def _quiet(sock: socket.socket) -> bool:
    """Whether nothing from the peer waits unread on ``sock`` (raw bytes: TLS records count too); never blocks."""
    try:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        return not poller.poll(0)
    except (OSError, ValueError):  # closed meanwhile
        return True


def _stop_reading(sock: socket.socket) -> None:
    """Wake the thread blocked reading ``sock`` (it reads end of stream); its write side stays open for the
    refusal. The plain socket's shutdown, also under TLS, whose own would drop the TLS layer first."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RD)
    except OSError:
        pass


def _send_refusal(sock: socket.socket, r: Refusal) -> None:
    """Tell the agent why (best effort: it may already be gone)."""
    try:
        send_all(sock, refusal(r.code.value[0], r.message), Deadline(5.0))
    except DataPlaneError:
        pass


def _peer_identity(sock: ssl.SSLSocket) -> PeerIdentity | None:
    """The verified client certificate's CN and serial (None if the client sent none)."""
    cert = sock.getpeercert()
    if not cert:
        return None
    names = [value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"]
    if not names:
        return None
    serial = cert.get("serialNumber")
    return PeerIdentity(names[0], int(serial, 16) if serial else None)


def start_data_plane(coordinator, loop, host: str, tls_control: bool, ssl_context: ssl.SSLContext | None,
                     intake: UploadIntake | None = None) -> DataPlaneServer | None:
    """Start the data plane if the coordinator's config asks for it; never in plaintext beside TLS gRPC."""
    config = coordinator.config
    if not config.wants_data_plane(coordinator.layout.total_bytes):
        return None
    if tls_control and ssl_context is None:
        log.warning("data plane off: gRPC uses TLS but no TLS context was given for the data plane; "
                    "weights move over the gRPC streams")
        return None
    server = DataPlaneServer(coordinator, loop, host, config.data_port, ssl_context, intake)
    coordinator.data_port = server.start()
    log.info("data plane listening on %s:%d (%s)", host, server.port, "TLS" if ssl_context else "plaintext")
    return server
