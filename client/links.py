"""How a client runtime (client/runtime.py) reaches its coordinator, joins it and pulls its members' tasks: the
settings that say how to reach it, the one connection (the control channel, and one kept channel per aggregator
rank a task names), and the two ways in that the coordinator's protocol has.

AgentLink: the runtime's one member is the runtime itself (a deployed agent, under its own certificate): Join,
PullTask long-polls, heartbeats while it trains, small updates in one UploadSmall call. HostLink: the runtime speaks
for a population of members (a simulation worker): JoinPopulation gives every member its own session,
its long-polls for the tasks of whichever members the coordinator sampled (carrying, under a virtual clock, their
finish estimates and the coordinator's go) go on one HostTaskStream, and small updates ride together on one
HostUploadStream. Everything after the pull (download, deadline, training, update transforms, upload) is the
runtime's, the same either way.

Calls that outlive the coordinator (:class:`Reconnecting`) back off while it is unreachable, with jittered
exponential backoff (client/backoff.py, also the runtime's upload retries), and join again when it no longer knows
the session (it restarted, or forgot a silent participant): one rule for every client of the coordinator, whether
it joins with Join (a deployed agent) or JoinPopulation (a population's host).
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, TypeVar

import grpc
import numpy as np

from fedpar.wording import counted
from fedpar.client.backoff import FIRST_BACKOFF_SECONDS, MAX_BACKOFF_SECONDS, Backoff, Uniform, sleep_unless
from fedpar.client.dataplane import answers_as_data_plane
from fedpar.client.host_stream import KeptStream
from fedpar.client.host_uploads import HostUploads
from fedpar.client.transfer import SendSmall, ingest_address, upload_small
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import (DEFAULT_CHUNK_BYTES, FRAMING_BYTES, MAX_POPULATION_JOIN, PROTOCOL_VERSION,
                                   SESSION_FREE_IN, SMALL_UPDATE_BYTES, CoordinatorStub, channel_options,
                                   entries_within, member_token, one_line)
from fedpar.protocol.task_settings import MAX_TASK_SECONDS
from fedpar.security.handshake import answers_http1, diagnose_handshake, lookup_trouble, tls_mismatch
from fedpar.security.tls import TlsFiles
from fedpar.task import UPLOAD_MARGIN_SECONDS

log = logging.getLogger("fedpar.client")
T = TypeVar("T")

REMIND_SECONDS = 300.0  # while the coordinator stays unreachable, a line says so this often (the first at once)
LEAVE_SECONDS = 2.0  # an agent's goodbye as it exits: not worth a longer wait on a coordinator that does not answer
MAX_INGEST_ADDRESSES = 64  # aggregator ranks kept dialed (each holds a channel, and a host's an upload thread)
MAX_CHUNK_BYTES = 64 << 20  # what a runtime's channels carry in one message (a coordinator's --max-chunk-bytes cap)
# A member's bytes in a JoinPopulation request besides its id: the newline after it, its examples and, if away, its
# index (varints of at most 10 bytes each)
JOIN_MEMBER_BYTES = 21
# Seconds a host's upload batch waits for more updates after its first (the round's last ones go at once): a fifth
# of the margin a member keeps free before the deadline. Each call costs both ends far more than its bytes (gRPC's
# per-call work); on a quiet machine 5, 20 and 50 ms gave the same 100-client digits round (0.08-0.09 s), on
# loaded cores 50 ms did best.
UPLOAD_LINGER = UPLOAD_MARGIN_SECONDS / 5
# A Join refused for a session another process holds waits for that place once, if it frees within this (a
# coordinator's --liveness-timeout is seconds to minutes), a little past the time the coordinator gave.
MAX_SESSION_WAIT_SECONDS = 3600.0
SESSION_MARGIN_SECONDS = 0.5
# RESOURCE_EXHAUSTED: a coordinator limit (join rate, calls in flight); backing off is the cure.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED})


def session_free_in(err: grpc.RpcError) -> float | None:
    """The seconds in which a refused Join's session, held by another process, is free unless that process is heard
    from (protocol/codec.SESSION_FREE_IN), or None when the refusal does not say (or says it oddly)."""
    for key, value in (err.trailing_metadata() or ()) if isinstance(err, grpc.Call) else ():
        if key == SESSION_FREE_IN:
            try:
                seconds = float(value)
            except ValueError:
                return None
            return seconds if 0 <= seconds <= MAX_SESSION_WAIT_SECONDS else None
    return None


def _duration(seconds: float) -> str:
    """``seconds`` as a person reads it: '42 s', '5 min', '2 h 5 min'."""
    if seconds < 120:
        return f"{seconds:.0f} s" if seconds >= 10 or seconds == int(seconds) else f"{seconds:.1f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 120 else f"{minutes // 60} h {minutes % 60} min"


class FatalAgentError(RuntimeError):
    """The coordinator refused this agent (or host) in a way retrying cannot fix."""


class IdTaken(FatalAgentError):
    """Another live process holds this agent's or host's session at the coordinator (``reason``: the coordinator's
    words)."""

    def __init__(self, who: str, reason: str):
        super().__init__(f"{who}: {reason}; another process runs under this id: stop it first, or give this one an id "
                         "of its own")
        self.reason = reason


class Reconnecting:
    """Runs calls to the coordinator at ``server`` for ``who``: a call refused UNAUTHENTICATED makes ``join`` run
    again (a new session) and is then retried; while the coordinator is unreachable (or busy) calls are retried
    with jittered exponential backoff from ``first`` to ``cap`` seconds, for ever or until ``give_up_after``
    seconds without reaching it. Any other refusal is a FatalAgentError. An outage is said when it begins, every
    ``remind`` seconds while it lasts (each retry only at debug level) and when it ends.

    ``stopped()``: the caller wants to leave (no more waiting); ``diagnose()``, asked when the coordinator is
    unreachable: what may be the cause, said in each retry line (e.g. its TLS setting differs), or None; it raises
    FatalAgentError for a cause retrying cannot cure (the agent's TLS handshake check); ``on_rejoin()``: counted.
    Joins are one at a time, and threads whose calls were refused under one session join again once between them.
    A join refused ALREADY_EXISTS (another process holds the session) waits once for the time the coordinator says
    that process has left unless heard from, and joins again; refused again (it was heard from), it is an IdTaken.
    """

    def __init__(self, who: str, server: str, join: Callable[[], None], first: float, cap: float, rng: Uniform,
                 give_up_after: float | None = None, stopped: Callable[[], bool] = lambda: False,
                 diagnose: Callable[[], str | None] = lambda: None, on_rejoin: Callable[[], None] = lambda: None,
                 remind: float = REMIND_SECONDS, level: int = logging.INFO):
        self.who, self.server, self._join = who, server, join
        self.level = level  # of the lines that say an outage and its end (a host's run shows only warnings)
        self.remind = remind  # while unreachable, a line says so this often (seconds)
        self.first, self.cap, self.rng = first, cap, rng
        self.give_up_after = give_up_after
        self.stopped, self.diagnose, self.on_rejoin = stopped, diagnose, on_rejoin
        self._join_lock = threading.Lock()
        self._sessions = 0  # joins done: a call refused under an older session than the latest is not a reason to join
        # An outage is said once, then every REMIND_SECONDS while it lasts, and its end is said; agents retry for
        # ever, and a line per retry filled their logs (18 lines in 72 s). Shared by every thread's calls.
        self._outage_lock = threading.Lock()
        self._outage_since: float | None = None  # when the current outage was first said (None: none)
        self._outage_said_at = 0.0  # when a line last said it
        self._outage_why = ""  # what that line said the cause may be (a new cause is said at once)

    def join(self) -> None:
        """Join, retried while the coordinator is unreachable (a refused join is fatal)."""
        with self._join_lock:
            self._retry(self._join, rejoin=False)
            self._sessions += 1

    def _join_again(self, refused_under: int) -> None:
        """Join again after a call made under session number ``refused_under`` was refused, unless another thread
        has joined since (its new session is the one to retry the call with)."""
        with self._join_lock:
            if self._sessions != refused_under:
                return
            self.on_rejoin()
            self._retry(self._join, rejoin=False)
            self._sessions += 1

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()``, joining again first whenever the coordinator no longer knows the session."""
        return self._retry(fn, rejoin=True)

    def _retry(self, fn: Callable[[], T], rejoin: bool) -> T:
        backoff = Backoff(self.first, self.cap, self.rng)
        unreachable_since = None
        rejoined = held_waited = False
        while True:
            session = self._sessions
            try:
                result = fn()
            except grpc.RpcError as err:
                code = err.code()
                if code not in RETRYABLE:  # it answered
                    self._reached()
                if code == grpc.StatusCode.UNAUTHENTICATED and rejoin:
                    if rejoined:  # the new session was not recognised either: a coordinator that forgets every
                        self._pause(backoff)  # session at once must not make us join a thousand times a second
                    log.info("%s: session not recognised (%s); joining again", self.who, one_line(err.details() or ""))
                    self._join_again(session)
                    rejoined = True
                    continue
                if code == grpc.StatusCode.ALREADY_EXISTS and not rejoin:
                    free_in = None if held_waited else session_free_in(err)
                    if free_in is None:  # the holder was heard from while this one waited: it is alive
                        raise IdTaken(self.who, one_line(err.details() or "")) from None
                    log.warning("%s: %s; waiting for that place (this may be the same agent started again after its "
                                "earlier process was killed), then joining", self.who, one_line(err.details() or ""))
                    held_waited = True
                    sleep_unless(free_in + SESSION_MARGIN_SECONDS, self.stopped)
                    if self.stopped():
                        raise FatalAgentError("stopped while waiting for the session another process held") from None
                    continue
                if code == grpc.StatusCode.UNIMPLEMENTED:  # a gRPC server, but not a coordinator's agents' port
                    raise FatalAgentError(f"{self.who}: {self.server} answers, but not as a coordinator (is it a "
                                          "service's control port?): give --server the coordinator's --port") from None
                if code not in RETRYABLE:
                    said = one_line(err.details() or "")
                    raise FatalAgentError(f"{self.who}: coordinator refused: {code.name}: {said}") from None
                mismatch = self.diagnose() if code == grpc.StatusCode.UNAVAILABLE else None
                why = f": {mismatch}" if mismatch else ""
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                waited = now - unreachable_since
                if self.give_up_after is not None and waited >= self.give_up_after:
                    raise FatalAgentError(f"{self.who}: coordinator at {self.server} unreachable for "
                                          f"{waited:.1f}s" + (why or "; is it running, and does its TLS "
                                          "setting (--certs/--insecure) match this agent's?")) from None
                if self.stopped():
                    raise FatalAgentError("stopped while the coordinator was unreachable") from None
                # the last wait ends as give_up_after runs out: one more try then, not a whole step past it
                sleep = backoff.wait(None if self.give_up_after is None else self.give_up_after - waited)
                self._say_unreachable(code, why, sleep)
                sleep_unless(sleep, self.stopped)
            else:
                self._reached()
                return result

    def _say_unreachable(self, code: grpc.StatusCode, why: str, sleep: float) -> None:
        """Say that the coordinator is unreachable: at once when an outage begins (or its likely cause changes),
        then every ``remind`` seconds while it lasts; each retry only at debug level. With ``give_up_after`` each retry
        is said, as the count-down to giving up it is (bounded by it)."""
        now = time.monotonic()
        with self._outage_lock:
            first = self._outage_since is None
            if first:
                self._outage_since = now
            lasted = now - self._outage_since
            if self.give_up_after is not None or first or why != self._outage_why:
                level, line = self.level, f"coordinator unreachable ({code.name}){why}; retrying in {sleep:.1f}s"
                if self.give_up_after is None:
                    line += f" (said again when it answers, or every {_duration(self.remind)} while it does not)"
            elif now - self._outage_said_at >= self.remind:
                level, line = self.level, (f"coordinator still unreachable after {_duration(lasted)} ({code.name})"
                                             f"{why}; retrying every {self.cap:.1f}s at most")
            else:
                level, line = logging.DEBUG, f"coordinator unreachable ({code.name}){why}; retrying in {sleep:.1f}s"
            if level == self.level:
                self._outage_said_at, self._outage_why = now, why
        log.log(level, "%s: %s", self.who, line)

    def _reached(self) -> None:
        """The coordinator answered: an outage that was said ends, and its end is said."""
        if self._outage_since is None:  # the common case, without the lock
            return
        with self._outage_lock:
            since, self._outage_since, self._outage_why = self._outage_since, None, ""
        if since is not None:
            log.log(self.level, "%s: coordinator at %s reachable again after %s", self.who, self.server,
                     _duration(time.monotonic() - since))

    def _pause(self, backoff: Backoff) -> None:
        """Wait ``backoff``'s next step, unless the caller wants to leave (FatalAgentError)."""
        if self.stopped():
            raise FatalAgentError("stopped while the coordinator kept refusing the session")
        sleep_unless(backoff.wait(), self.stopped)


@dataclass
class AgentConfig:
    """How a client runtime reaches its coordinator and paces itself (``agent_id``: its identity there: a deployed
    agent's own id, or a simulation host's)."""

    server: str
    agent_id: str
    poll_seconds: float = 5.0  # long-poll wait per pull
    initial_backoff: float = FIRST_BACKOFF_SECONDS
    max_backoff: float = MAX_BACKOFF_SECONDS
    give_up_after: float | None = None  # seconds without reaching the coordinator; None: never
    upload_margin_seconds: float = UPLOAD_MARGIN_SECONDS  # kept free before the deadline beyond the upload estimate
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    credentials: grpc.ChannelCredentials | None = None  # TLS (mTLS with a client certificate) for every channel
    insecure: bool = False  # a plaintext channel instead: only asked for explicitly (loopback, tests)
    tls_server_name: str | None = None  # name to check the coordinator's certificate for, if not the host
    enrollment_token: str = ""  # for coordinators that admit agents without certificates by token
    drop_probability: float = 0.0  # simulations: chance of vanishing for a round
    seed: int | None = None  # drop decisions and backoff jitter; None: fresh entropy (agents must not move in lockstep)
    data_plane: bool = True  # move weights over the coordinator's data plane when a task offers it
    data_tls: ssl.SSLContext | None = None  # TLS for the data plane; without it a TLS agent keeps to gRPC
    tls_files: TlsFiles | None = None  # the PEM files behind ``credentials``: to say why a handshake fails
    task: str = ""  # the task it trains, declared at Join (a service samples for a run only agents that have its task)
    population: int = 0  # a host's: the whole population its slice is of, declared at JoinPopulation (0: unsaid)

    def __post_init__(self) -> None:
        """ValueError unless the channel's security is said: credentials for TLS, or insecure=True for plaintext."""
        if self.credentials is None and not self.insecure:
            raise ValueError("AgentConfig has no credentials: pass credentials=... (grpc.ssl_channel_credentials) for "
                             "TLS, or insecure=True for a plaintext channel (loopback and tests only)")
        if self.credentials is not None and self.insecure:
            raise ValueError("AgentConfig: credentials and insecure=True contradict each other; drop one")


class Connection:
    """The channel to ``config.server`` and, opened on first use and kept, one to each aggregator rank."""

    def __init__(self, config: AgentConfig):
        self.config = config
        self.channel = self._open(config.server)
        self.stub = CoordinatorStub(self.channel)
        self._ingest: dict[str, tuple[grpc.Channel, CoordinatorStub]] = {}  # aggregator ranks' channels by address
        # seats ask at once: one channel per rank (a host's second stub to a rank would open a second upload stream,
        # which the rank refuses)
        self._ingest_lock = threading.Lock()

    def _open(self, address: str) -> grpc.Channel:
        options = channel_options(MAX_CHUNK_BYTES)
        if self.config.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.config.tls_server_name))
        if self.config.credentials is not None:
            return grpc.secure_channel(address, self.config.credentials, options=options)
        return grpc.insecure_channel(address, options=options)

    def check_ingest(self, task: pb.TrainTask) -> None:
        """ValueError (one line) unless the aggregator rank ``task`` names is one to dial: a port, a host name, and
        one of the first MAX_INGEST_ADDRESSES (a coordinator naming a new one each round would grow them unbounded)."""
        if not task.ingest_port:
            return
        host = task.ingest_host
        if task.ingest_port > 65535 or len(host) > 253 or not host.isprintable() or any(c.isspace() for c in host):
            raise ValueError(f"the task names aggregator rank host {host[:64]!r} port {task.ingest_port}, which cannot "
                             "be dialed")
        address = ingest_address(self.config.server, task)
        with self._ingest_lock:
            if address != self.config.server and address not in self._ingest \
                    and len(self._ingest) >= MAX_INGEST_ADDRESSES:
                raise ValueError(f"the task names aggregator rank {address!r}, one more than the "
                                 f"{MAX_INGEST_ADDRESSES} this agent keeps dialed")

    def ingest_stub(self, task: pb.TrainTask) -> CoordinatorStub:
        """The stub for the task's download and upload (one channel per aggregator rank, kept open)."""
        address = ingest_address(self.config.server, task)
        if address == self.config.server:
            return self.stub
        with self._ingest_lock:
            if address not in self._ingest:
                channel = self._open(address)
                self._ingest[address] = (channel, CoordinatorStub(channel))
            return self._ingest[address][1]

    def rank_address(self, stub: CoordinatorStub) -> str:
        """The aggregator rank's address ``stub`` calls ('' for the coordinator's own)."""
        with self._ingest_lock:
            return next((address for address, (_, kept) in self._ingest.items() if kept is stub), "")

    def why_unreachable(self) -> str | None:
        """Why the coordinator is unreachable (gRPC says only UNAVAILABLE): a host name that cannot be looked up for
        now (no DNS server answered) or a TLS setting that differs from ours is returned, to be said in each retry
        line (DNS may come back; its operator may restart it with ours); a host name no DNS server knows, a web
        server's port or a coordinator's data-plane port, a wrong CA, a name mismatch or a refused
        certificate, which retrying does not cure, is a FatalAgentError."""
        lookup = lookup_trouble(self.config.server, "--server")
        if lookup is not None and not lookup[1]:  # no DNS server answered: retried, the reason in each retry's line
            return lookup[0]
        # a web server answers at once: a host that drops packets holds each retry 1 s more, not 3
        unknown = (lookup[0] if lookup is not None else None) or answers_http1(self.config.server, 1.0) or \
            answers_as_data_plane(self.config.server, 1.0)
        if unknown is not None:
            raise FatalAgentError(f"{self.config.agent_id}: {unknown}")
        mismatch = tls_mismatch(self.config.server, self.config.credentials is None)
        if mismatch is not None or self.config.credentials is None or self.config.tls_files is None:
            return mismatch
        problem = diagnose_handshake(self.config.server, self.config.tls_files, self.config.tls_server_name)
        if problem is not None:
            raise FatalAgentError(f"{self.config.agent_id}: {problem}")
        return None

    def close(self) -> None:
        """Close every channel."""
        self.channel.close()
        with self._ingest_lock:
            channels = [channel for channel, _ in self._ingest.values()]
        for channel in channels:
            channel.close()


class Members(Protocol):
    """Which members a runtime hosts and what each brings (its id, its examples, its data for a seat, whether it
    vanishes in a round); a population's adds its availability and its simulated finish times."""

    population: bool  # True: joined as a population (HostLink); False: the member is the runtime itself (AgentLink)
    answers_messages: bool  # True: the members answer a Flower App's Messages (no model layout of their own)

    def __len__(self) -> int: ...

    def member_id(self, i: int) -> str:
        """Member ``i``'s id at the coordinator."""

    def seat_trainers(self, seats: int) -> list:
        """The trainers the runtime's seats train with (a member takes one over for a task: :meth:`assign`)."""

    def assign(self, trainer, i: int, task: pb.TrainTask) -> None:
        """Make ``trainer`` train as member ``i`` for ``task`` (its data, seed and speed)."""

    def vanishes(self, i: int, round_id: int) -> bool:
        """Whether member ``i`` takes no part in round ``round_id`` (drops out, or is offline)."""

    def answer(self, i: int, data: bytes, max_bytes: int, run_config: dict | None = None):
        """Only where :attr:`answers_messages`: member ``i``'s reply to the Flower Message ``data``, at most
        ``max_bytes`` (an Answer, client/flower_app_member.py: the reply, why it is Flower's error reply, and the type
        of the message it answers)."""


class Population(Members, Protocol):
    """Members joined as a population (HostLink): what the coordinator is told of each, and their simulated
    availability and finish times."""

    def index_of(self, member: str) -> int:
        """The index of the member whose id is ``member`` (KeyError: not one of these)."""

    def train_size(self, i: int) -> int:
        """Member ``i``'s training examples (told at join, and the virtual clock's measure of its work)."""

    def joining(self, start: int, stop: int) -> tuple[list[str], np.ndarray, np.ndarray]:
        """What the coordinator is told of members ``start``..``stop - 1`` at join, as arrays: their ids, training
        examples (int64, at least 1) and whether each is away now (bool)."""

    def availability_changes(self, clock_seconds: float | None) -> tuple[list[str], list[str]]:
        """Members gone offline and come back since the last call (``clock_seconds``: the coordinator's
        simulated time, None without a virtual clock)."""

    def validation(self, i: int):
        """Member ``i``'s validation split (None without one), for a seat that scores several members at once."""

    def finish_estimate(self, i: int, task: pb.TrainTask) -> float:
        """Member ``i``'s simulated seconds for ``task`` (-1: it would not upload); sets ``task.max_steps``."""


def session_token(token: str, config: AgentConfig) -> str:
    """``token``, the session a join reply gave; FatalAgentError when it gave none (every later call would be
    refused, and joining again would get none again)."""
    if not token:
        raise FatalAgentError(f"{config.agent_id}: {config.server} answered the join without a session token: is it a "
                              "fedpar coordinator?")
    return token


def heartbeat_interval(seconds: float, config: AgentConfig) -> float:
    """The seconds between heartbeats a Join reply asks for (0: 5 s); FatalAgentError for one no clock can wait
    (NaN, negative, or longer than a timeout may be)."""
    if not 0 <= seconds <= MAX_TASK_SECONDS:
        raise FatalAgentError(f"{config.agent_id}: {config.server} answered the join with a heartbeat interval of "
                              f"{seconds} s: it must be in [0, {MAX_TASK_SECONDS:.0e}]")
    return seconds or 5.0


def check_task_clock(task: pb.TrainTask) -> None:
    """ValueError (one line) unless a virtual-clock task's simulated time and deadline are seconds a clock can
    hold (a time that is not is no simulated finish time's start)."""
    if task.virtual_clock and not (0 <= task.clock_seconds < math.inf
                                   and task.clock_deadline_seconds <= MAX_TASK_SECONDS):
        raise ValueError(f"the task's simulated time {task.clock_seconds} s and deadline "
                         f"{task.clock_deadline_seconds} s must be finite, the time >= 0, the deadline at most "
                         f"{MAX_TASK_SECONDS:.0e} s")


def chunk_limit(max_chunk_bytes: int, config: AgentConfig) -> int:
    """The chunk size a join reply allows (0: DEFAULT_CHUNK_BYTES); FatalAgentError for one past what this
    runtime's channels carry (every whole update sent in one message would be refused)."""
    if max_chunk_bytes > MAX_CHUNK_BYTES:
        raise FatalAgentError(f"{config.agent_id}: {config.server} answered the join with chunks of {max_chunk_bytes} "
                              f"bytes: they must be at most {MAX_CHUNK_BYTES}")
    return max_chunk_bytes or DEFAULT_CHUNK_BYTES


@dataclass
class Pulled:
    """What one pull brought: tasks by member index, or the coordinator's reason to stop."""

    tasks: list[tuple[int, pb.TrainTask]] = field(default_factory=list)
    shutdown: str | None = None
    news: bool = False  # the reply said more than its tasks (a virtual clock's step): not an idle turn


def agent_capabilities(config: AgentConfig, framework: str) -> dict[str, str]:
    """What an agent tells the coordinator at Join: its trainer's framework and, if it has one, its task."""
    return {"framework": framework, **({"task": config.task} if config.task else {})}


class AgentLink:
    """The runtime is its one member: Join under ``config.agent_id``, PullTask, heartbeats while training."""

    def __init__(self, conn: Connection, config: AgentConfig, trainer):
        self.conn, self.config, self.trainer = conn, config, trainer
        self.auth: pb.AgentAuth | None = None
        self.max_chunk = max(config.chunk_bytes, DEFAULT_CHUNK_BYTES)
        self.small_below = SMALL_UPDATE_BYTES  # updates of fewer bytes go whole, without waiting for admission
        self._heartbeat_seconds = 5.0
        self._heard: tuple[float, int] | None = None  # (time.monotonic(), round) of the last heartbeat reply
        self._finished_task_id = ""  # told to the coordinator, which then never hands that task out again
        self._failure = ""  # why the agent's own code failed that task, told with it
        self._failure_told = True  # by a pull since it failed (one not told yet is told as the agent leaves)
        self._heartbeat = _Heartbeat(self._send_heartbeat, lambda: self._heartbeat_seconds)
        self.incarnation = secrets.token_hex(16)  # with every Join: a Join sent again after its reply was lost is ours

    def join(self) -> None:
        """A new session for the agent. The session it held, if any, goes with the call: it proves this process may
        take the agent's place back, which the coordinator refuses (ALREADY_EXISTS) to another process while this
        one's session is live."""
        reply = self.conn.stub.Join(pb.JoinRequest(agent_id=self.config.agent_id,
                                                   num_examples=self.trainer.num_examples,
                                                   capabilities=agent_capabilities(self.config,
                                                                                   self.trainer.framework),
                                                   protocol_version=PROTOCOL_VERSION,
                                                   enrollment_token=self.config.enrollment_token,
                                                   replaces_token=self.auth.token if self.auth else "",
                                                   incarnation=self.incarnation), timeout=30)
        self.auth = pb.AgentAuth(agent_id=self.config.agent_id, token=session_token(reply.token, self.config))
        self._heartbeat_seconds = heartbeat_interval(reply.heartbeat_seconds, self.config)
        self.max_chunk = chunk_limit(reply.max_chunk_bytes, self.config)

    def pull(self) -> Pulled:
        """One PullTask long-poll."""
        reply = self._pull(self.config.poll_seconds, self.config.poll_seconds + 30)
        kind = reply.WhichOneof("kind")
        if kind == "shutdown_reason":
            return Pulled(shutdown=one_line(reply.shutdown_reason))
        if kind == "task" and reply.task.task_id == self._finished_task_id != "":
            # told done with it in this very pull: training it again would upload a second update for one task
            log.info("%s: the coordinator handed out task %s of round %d again, which this agent is done with; "
                     "skipped", self.config.agent_id, one_line(reply.task.task_id, 64), reply.task.round)
            return Pulled()
        return Pulled([(0, reply.task)] if kind == "task" else [])

    def _pull(self, wait_seconds: float, timeout: float) -> pb.PullTaskReply:
        """A PullTask waiting up to ``wait_seconds``, telling the task the agent is done with (and its failure)."""
        failure = self._failure
        reply = self.conn.stub.PullTask(pb.PullTaskRequest(auth=self.auth, wait_seconds=wait_seconds,
                                                           finished_task_id=self._finished_task_id, failure=failure),
                                        timeout=timeout)
        self._failure_told = self._failure_told or failure == self._failure
        return reply

    def _registered(self, member: str) -> tuple[int, int]:
        """A member's examples as told at join and the local epochs of its task: its update's weight bound."""
        return max(1, self.members.train_size(self.members.index_of(member))), self.local_epochs

    def member_auth(self, i: int) -> pb.AgentAuth:
        """The agent's session."""
        return self.auth

    def finished(self, task: pb.TrainTask) -> None:
        """Done with ``task``: said on the next pull, so it is not handed out again."""
        if task.task_id != self._finished_task_id:
            self._failure = ""
        self._finished_task_id = task.task_id

    def failed(self, i: int, task: pb.TrainTask, reason: str) -> None:
        """The agent's own code failed ``task`` (``reason``: one line): said with it on the next pull."""
        self._finished_task_id, self._failure, self._failure_told = task.task_id, reason, False

    def small_sender(self, topk: bool, stub: CoordinatorStub) -> SendSmall:
        """How a small update goes: one UploadSmall call."""
        return upload_small

    def while_training(self) -> contextlib.AbstractContextManager:
        """Heartbeats flow inside this block."""
        return self._heartbeat.while_training()

    def close(self) -> None:
        """Stop the heartbeat thread and leave the coordinator (if it still answers): a process started again under
        this id need not wait for this one's session to lapse; a failed task not told yet is told first (the agent
        stops on a failure no round can cure: its round need not wait out its deadline)."""
        self._heartbeat.close()
        if self.auth is not None:
            try:
                if not self._failure_told:
                    self._pull(0.0, LEAVE_SECONDS)
                self.conn.stub.Leave(pb.LeaveRequest(auth=self.auth), timeout=LEAVE_SECONDS)
            except grpc.RpcError:  # gone, or it forgot this session: there is nothing to leave
                pass

    def leaving(self) -> None:
        """Nothing: the agent leaves as it closes, with no seats to wait for first."""

    def tasks_in_flight(self, change: int) -> None:
        """Nothing: the agent's one member trains between its pulls, no task waits for a seat."""

    def _send_heartbeat(self) -> None:
        reply = self.conn.stub.Heartbeat(pb.HeartbeatRequest(auth=self.auth), timeout=self._heartbeat_seconds)
        self._heard = (time.monotonic(), reply.current_round)

    def round_heard_since(self, since: float) -> int | None:
        """The coordinator's current round as a heartbeat reply said it after ``since`` (time.monotonic()); None
        when none came since."""
        heard = self._heard
        return heard[1] if heard is not None and heard[0] > since else None


class HostLink:
    """The runtime speaks for ``members`` under ``config.agent_id`` (the host's id): JoinPopulation,
    HostTaskStream, small updates batched on one HostUploadStream to each aggregator rank they go to.
    ``forget_queued()``: drop the tasks no seat started (their sessions are gone); ``trainable(i, task)``: whether
    member ``i`` is to train ``task`` (one that is not is refused and told as its failure)."""

    def round_heard_since(self, since: float) -> int | None:
        """None: a host sends no heartbeats (its task stream tells it of new rounds)."""
        return None

    def __init__(self, conn: Connection, config: AgentConfig, members: Population, forget_queued: Callable[[], None],
                 trainable: Callable[[int, pb.TrainTask], bool]):
        self.conn, self.config, self.members, self._trainable = conn, config, members, trainable
        self.host = pb.AgentAuth(agent_id=config.agent_id)
        self.incarnation = secrets.token_hex(16)  # with every JoinPopulation: one sent again after a lost reply is ours
        self.max_chunk = 0
        self.small_below = 0
        self.clock_seconds: float | None = None  # the coordinator's simulated time, once it runs a virtual clock
        self._held: dict[str, tuple[int, pb.TrainTask]] = {}  # virtual clock: tasks waiting for the coordinator's go
        # (member, task id) of the tasks taken in the round of the last task: O(cohort), not a record of every member
        # ever sampled (a host may hold a million); a service's next run counts rounds from 1 again
        self._taken: set[tuple[str, str]] = set()
        self._taken_round = 0
        self._estimates: list[pb.FinishEstimate] = []  # virtual clock: finish times to report on the next call
        self._availability: dict[str, bool] = {}  # members gone offline (True) or back (False), until a pull tells it
        self._failures: list[pb.TaskFailure] = []  # members' tasks their own code failed, for the next call
        self._failures_lock = threading.Lock()  # the seats add them, the pulls take them
        self._forget_queued = forget_queued
        self._in_flight = 0  # members' tasks queued or training: their updates may still join the next batch
        self._in_flight_lock = threading.Lock()
        self.uploads: dict[CoordinatorStub, HostUploads] = {}  # the members' small updates, by the rank they go to
        self._uploads_lock = threading.Lock()  # seats add a rank's the first time they upload there
        self._closed = False
        self._left = False  # it said goodbye (Leave): its session is over
        self._tasks = KeptStream(self.conn.stub.HostTaskStream, "task stream")  # the long-polls, opened at the first
        self.local_epochs = 1  # the latest task's: with a member's examples, the bound on its update's weight

    def join(self) -> None:
        """A new session for the host and every member, up to MAX_POPULATION_JOIN members per call; what was queued
        for the old sessions is moot. The session this host held (the latest the coordinator gave it, a join cut short
        included) goes with the first call: it proves this process may take the host's place back, which the
        coordinator refuses (ALREADY_EXISTS) to another process while this one's session is live."""
        held, session = self.host.token, ""  # a new session, whatever the coordinator remembers
        # each call within the coordinator's limit: its chunk plus framing, known from its first reply; the first
        # fits the framing alone (a coordinator of --max-chunk-bytes 4096 refused 10,000 members' every call)
        room, start = FRAMING_BYTES // 2, 0
        while start < len(self.members):
            most = max(1, min(MAX_POPULATION_JOIN, room // (JOIN_MEMBER_BYTES + 1)))  # no more ids made than can fit
            ids, sizes, away = self.members.joining(start, min(start + most, len(self.members)))
            count = entries_within(ids, room, JOIN_MEMBER_BYTES)
            ids, sizes, away = ids[:count], sizes[:count], away[:count]
            start += count
            request = pb.JoinPopulationRequest(host=pb.AgentAuth(agent_id=self.host.agent_id, token=session),
                                               replaces_token="" if session else held, incarnation=self.incarnation,
                                               protocol_version=PROTOCOL_VERSION,
                                               enrollment_token=self.config.enrollment_token,
                                               capabilities=self._capabilities(),
                                               member_ids="\n".join(ids), num_examples=sizes,
                                               away=np.flatnonzero(away))
            reply = self.conn.stub.JoinPopulation(request, timeout=60)
            session = self.host.token = session_token(reply.host_token, self.config)
            self.max_chunk = chunk_limit(reply.max_chunk_bytes, self.config)
            room = self.max_chunk + FRAMING_BYTES // 2
        self.small_below = self.max_chunk + 1  # whole updates up to a chunk ride in the host's batches
        self._held.clear()
        self._taken.clear()
        self._estimates = []
        self._forget_queued()

    def _capabilities(self) -> dict[str, str]:
        """What the host declares at JoinPopulation: its members' task and the whole population, where known."""
        said = {"task": self.config.task} if self.config.task else {}
        return {**said, "population": str(self.config.population)} if self.config.population else said

    def tasks_in_flight(self, change: int) -> None:
        """``change`` members' tasks queued for the seats (> 0), or done with or forgotten (< 0; each one's update, if
        any, queued by then): a batch waits for more updates only while some are in flight."""
        with self._in_flight_lock:
            self._in_flight += change
            done = self._in_flight == 0
        if done and change < 0:  # a lingering batch goes now
            with self._uploads_lock:
                batches = list(self.uploads.values())
            for uploads in batches:
                uploads.nudge()

    def _availability_to_tell(self) -> list[str]:
        """The members whose availability changes the next pull tells, oldest change first: as many as half the
        coordinator's --max-chunk-bytes holds (a million members' diurnal traces can change more at once than one
        request carries)."""
        members = list(self._availability)
        return members[:entries_within(members, max(self.max_chunk, 1024) // 2)]

    def pull(self) -> Pulled:
        """One long-poll on the host's task stream: the tasks to start now (under a virtual clock: those the
        coordinator let go; the others wait, their simulated finish times reported on the next call). Tasks for
        members this host does not hold, a member's second task of one reply, a task it took already, and a
        virtual-clock task it would not train are skipped in one line (a bad one told as its member's failure)."""
        for member_ids, gone in zip(self.members.availability_changes(self.clock_seconds), (True, False)):
            self._availability.update(dict.fromkeys(member_ids, gone))  # a pull that fails tells them on the next
        told = self._availability_to_tell()
        rest = len(told) < len(self._availability)  # more than one request holds: told over the next pulls, at once
        with self._failures_lock:
            failures = list(self._failures)
        at = -1.0 if self.clock_seconds is None or rest else self.clock_seconds  # as of then once all are told
        reply = self._tasks.send(pb.PullHostTasksRequest(
            host=self.host, wait_seconds=0.0 if rest else self.config.poll_seconds,
            away=[m for m in told if self._availability[m]], back=[m for m in told if not self._availability[m]],
            availability_at=at, finish_estimates=self._estimates, failures=failures),
            timeout=self.config.poll_seconds + 30)
        self._estimates = []
        for member in told:
            del self._availability[member]
        with self._failures_lock:  # told (seats only add at the end)
            del self._failures[:len(failures)]
        if reply.shutdown_reason:
            return Pulled(shutdown=one_line(reply.shutdown_reason))
        # availability follows the simulated time, which also moves between rounds: a step is news (pull again at
        # once), the same time said again is not (a coordinator that says it at once must not make the host spin)
        pulled = Pulled(news=reply.virtual_clock and self._clock_at(reply.clock_seconds))
        if reply.tasks and self._held:  # tasks held from an older round are moot once a newer one opens
            newest = max(hosted.task.round for hosted in reply.tasks)
            self._held = {m: held for m, held in self._held.items() if held[1].round >= newest}
        skipped: dict[str, list[str]] = {}  # why: the members (as the coordinator named them) skipped for it
        named: set[str] = set()  # the members this reply handed a task
        for hosted in reply.tasks:
            i = self._take(hosted, named, skipped)
            if i is None:
                continue
            self.local_epochs = hosted.task.local_epochs
            if reply.weights:  # the round's small model, sent once for all of them
                hosted.task.weights_header.CopyFrom(reply.weights_header)
                hosted.task.weights = reply.weights
            if hosted.task.virtual_clock:
                if not self._trainable(i, hosted.task):  # refused and told now: no finish time to report for it
                    continue
                self._clock_at(hosted.task.clock_seconds)
                self._held[hosted.agent_id] = (i, hosted.task)
                seconds = self.members.finish_estimate(i, hosted.task)
                self._estimates.append(pb.FinishEstimate(agent_id=hosted.agent_id, task_id=hosted.task.task_id,
                                                         seconds=seconds))
            else:
                pulled.tasks.append((i, hosted.task))
        for why, members in skipped.items():
            log.warning("%s: the coordinator handed out %s %s (e.g. %s); skipped", self.host.agent_id,
                        counted(len(members), "task"), why, one_line(members[0], 64))
        pulled.tasks += [self._held.pop(member) for member in reply.go if member in self._held]
        return pulled

    def _take(self, hosted: pb.HostedTask, named: set[str], skipped: dict[str, list[str]]) -> int | None:
        """The index of the member ``hosted`` is for, or None (noted in ``skipped``): not a member of this host, or
        named again (twice in this reply, ``named`` so far, or with a task it took already: each task trains once)."""
        member = hosted.agent_id
        try:
            i = self.members.index_of(member)
        except KeyError:
            skipped.setdefault("for members this host does not hold", []).append(member)
            return None
        if hosted.task.round != self._taken_round:
            self._taken.clear()
            self._taken_round = hosted.task.round
        taken = (member, hosted.task.task_id)
        if member in named or taken in self._taken:
            skipped.setdefault("to members named twice, or again with a task they took", []).append(member)
            return None
        named.add(member)
        self._taken.add(taken)
        return i

    def _clock_at(self, seconds: float) -> bool:
        """Take ``seconds`` as the coordinator's simulated time; whether it moved on. A time no clock reads (NaN,
        infinite, negative) is refused in one line and not taken."""
        if not 0 <= seconds < math.inf:
            log.warning("%s: the coordinator's simulated time is %s s; ignored", self.host.agent_id, seconds)
            return False
        moved = self.clock_seconds is None or seconds > self.clock_seconds
        self.clock_seconds = seconds
        return moved

    def _registered(self, member: str) -> tuple[int, int]:
        """A member's examples as told at join and the local epochs of its task: its update's weight bound."""
        return max(1, self.members.train_size(self.members.index_of(member))), self.local_epochs

    def member_auth(self, i: int) -> pb.AgentAuth:
        """Member ``i``'s session."""
        member = self.members.member_id(i)
        return pb.AgentAuth(agent_id=member, token=member_token(self.host.token, member))

    def finished(self, task: pb.TrainTask) -> None:
        """Nothing to tell: the coordinator counts a member's task done when its update arrives."""

    def failed(self, i: int, task: pb.TrainTask, reason: str) -> None:
        """Member ``i``'s own code failed ``task`` (``reason``: one line): said at once on the host's upload stream to
        the coordinator (the pull in flight may wait seconds more), and again on the host's next pull (a
        coordinator counts it once)."""
        failure = pb.TaskFailure(agent_id=self.members.member_id(i), task_id=task.task_id, reason=reason)
        with self._failures_lock:
            self._failures.append(failure)
        self._uploads_to(self.conn.stub).tell(failure)

    def small_sender(self, topk: bool, stub: CoordinatorStub) -> SendSmall:
        """How a small update goes: in the host's next batch to ``stub`` (the coordinator, or the aggregator rank the
        task names); waiting for its own result when top-k's error feedback must know whether it counted, else in the
        background while the seat trains its next member."""
        uploads = self._uploads_to(stub)
        return uploads.send if topk else uploads.send_later

    def _uploads_to(self, stub: CoordinatorStub) -> HostUploads:
        """The batches to ``stub`` (a few ms' wait for seats still training), started at its first update."""
        with self._uploads_lock:
            uploads = self.uploads.get(stub)
            if uploads is None:
                uploads = self.uploads[stub] = HostUploads(stub, self.host, self.max_chunk, linger=UPLOAD_LINGER,
                                                           more_coming=lambda: self._in_flight > 0,
                                                           registered=self._registered,
                                                           rank=self.conn.rank_address(stub))
                if self._closed:  # a seat that outlived the run: its update is refused, as closed batches refuse
                    uploads.close()
            return uploads

    def while_training(self) -> contextlib.AbstractContextManager:
        """No heartbeats: the host's pulls say its members are alive."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """End the task stream, send the batches queued, then leave the coordinator (if it still answers): the round
        open need not wait out its deadline for the members it sampled, and none is sampled again."""
        self._tasks.close()
        with self._uploads_lock:
            self._closed = True
            batches = list(self.uploads.values())
        for uploads in batches:
            uploads.close()
        refused = sum(uploads.refused_in_background for uploads in batches)
        if refused and not self._left:
            log.warning("%s: %d updates sent in the background were refused (--log-level info says why)",
                        self.host.agent_id, refused)
        late = sum(uploads.came_after_close for uploads in batches)
        if late:
            log.info("%s: %d updates came after their round had closed (overselection's surplus)",
                     self.host.agent_id, late)
        self.leaving()

    def leaving(self) -> None:
        """Leave the coordinator (once, if it still answers): the open round stops waiting for the members it sampled,
        and none is sampled again. A signal's stop says it at once, and does not wait for the seats' last tasks: an
        update of theirs that still comes finds the session gone, which is no refusal to warn of."""
        if not self.host.token or self._left:
            return
        self._left = True
        try:
            self.conn.stub.Leave(pb.LeaveRequest(auth=self.host), timeout=LEAVE_SECONDS)
        except grpc.RpcError:  # gone, or it forgot this session: there is nothing to leave
            pass


class _Heartbeat:
    """One background thread per agent that sends heartbeats while it trains, so the coordinator knows it is
    alive (started on first use and kept: a thread per task would cost more than a small model's round)."""

    def __init__(self, send: Callable[[], None], every: Callable[[], float]):
        self._send, self._every = send, every
        self._training = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def while_training(self) -> Iterator[None]:
        """Heartbeats flow inside this block."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fedpar-heartbeat", daemon=True)
            self._thread.start()
        self._training.set()
        try:
            yield
        finally:
            self._training.clear()

    def close(self) -> None:
        """Stop the thread."""
        self._closed.set()
        self._training.set()  # wake it
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while self._training.wait() and not self._closed.wait(self._every()):
            if not self._training.is_set():
                continue
            try:
                self._send()
            except grpc.RpcError:
                pass  # the main loop handles an unreachable coordinator

