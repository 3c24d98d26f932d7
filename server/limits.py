"""The limits every gRPC call is held to: the per-agent and server-wide counts (:class:`Limits`), and the
interceptor that checks and counts each call before its handler runs (:class:`RpcLimit`), and the strangers'
bounds (:class:`StrangerBound`).

Every refusal is a :class:`Refusal` with RESOURCE_EXHAUSTED and a message saying which limit and
which option raises it. All state is per agent id and bounded by the agents active now, not by all that ever
called: per-call counts end with their calls, upload attempts with their round, byte buckets once refilled. The
coordinator's event loop is the only user of the counts, so they do not lock (the strangers' bounds do).

What every call passes before its handler runs: the revocation check, and the budget it is counted in.

- A client certificate that was revoked is refused at the first call, before anything is read or counted.
- Every call starts as a stranger's: until it has sent its request (a unary call) or its upload header and
  session (an upload stream), it counts only against the strangers' bounds (``--max-unauthenticated-calls`` in
  total, ``--max-unauthenticated-per-peer`` per peer: its certificate's name, else its address), never the
  honest budget; beyond either bound the oldest such call is let go (:class:`StrangerBound`), and a call must send
  its request within ``--upload-header-seconds``. gRPC would hand a unary handler its request only once it
  arrived, holding a call whose request never comes uncounted and without limit, so unary methods are served
  here as one-message request streams (the same bytes on the wire). A unary call leaves the strangers' bounds
  when its request arrives (it authenticates before it waits on anything); an upload stream when the handler
  calls :func:`authenticated`. Both then count against ``--max-concurrent-rpcs`` for as long as they run. A unary
  call's request normally comes with the call, so it enters the strangers' bounds only if it is still missing
  after REQUEST_GRACE_SECONDS: a flood from an agent's own address (NAT) cannot let go of an agent's call.

- grpc.health.v1 calls are unauthenticated: they count in the strangers' bounds for their whole life (a Watch
  stream too), never in ``--max-concurrent-rpcs``, so a probe is answered however busy the agents keep it.

gRPC's own ``maximum_concurrent_rpcs`` answers "Concurrent RPC limit exceeded!", which does not tell an
operator which option to raise, so the counts live here.

The strangers' bounds: bounds on work done for peers that have not authenticated yet (gRPC streams awaiting their
header, data-plane connections awaiting their handshake and ticket), per peer and in total.

When a bound is full the *oldest* waiting entry is let go, not the newcomer (preferring one that has sent nothing
we have not read, when the owner can tell): an honest agent authenticates within milliseconds of connecting, so a
stranger's silent calls can fill the bound but never lock out an agent sharing its address (NAT, loopback). Used
from the event loop and from data-plane threads, so it locks.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
import time
from collections import OrderedDict
from contextlib import asynccontextmanager, contextmanager
from typing import AsyncIterator, Callable, Iterator

import grpc

from fedpar.security.admission import Admission, AdmissionRefused, PeerIdentity, peer_identity
from fedpar.server.config import CoordinatorConfig
from fedpar.server.rounds import Refusal

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
# grpc.health.v1 is unauthenticated: its calls stay in the strangers' bounds for their whole life, so a probe is
# never refused because agents fill --max-concurrent-rpcs, and a flood of probes (or of Watch streams) cannot
# take agents' places.
HEALTH_METHODS = "/grpc.health.v1.Health/"
REQUEST_GRACE_SECONDS = 0.25  # a unary call's request normally comes with the call: only a later one is a stranger's


class Stranger:
    """One unauthenticated call or connection; ``evict(refusal)`` is how its owner is told to let it go."""

    __slots__ = ("peer", "evict", "quiet", "evicted", "started", "_bound")

    def __init__(self, bound: StrangerBound, peer: str, evict: Callable[[Refusal], None],
                 quiet: Callable[[], bool] | None = None):
        self._bound, self.peer, self.evict, self.quiet = bound, peer, evict, quiet
        self.evicted: Refusal | None = None  # set when a bound or its deadline let it go
        self.started = time.monotonic()

    def done(self) -> None:
        """It authenticated or ended: it no longer counts (idempotent)."""
        self._bound.remove(self)


class StrangerBound:
    """At most ``total`` unauthenticated entries, at most ``per_peer`` of them from one peer (oldest out first)."""

    def __init__(self, total: int, per_peer: int, total_option: str, per_peer_option: str, what: str):
        self.total, self.per_peer = total, per_peer
        self._options = (total_option, per_peer_option)
        self._what = what
        self._all: OrderedDict[Stranger, None] = OrderedDict()
        self._by_peer: dict[str, OrderedDict[Stranger, None]] = {}
        self._lock = threading.Lock()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._all)

    def admit(self, peer: str, evict: Callable[[Refusal], None], quiet: Callable[[], bool] | None = None) -> Stranger:
        """Count a new unauthenticated entry from ``peer``; beyond either bound lets the oldest go (``evict``),
        the oldest ``quiet()`` one (nothing unread from it) if there is one."""
        entry = Stranger(self, peer, evict, quiet)
        victims: list[Stranger] = []
        with self._lock:
            mine = self._by_peer.setdefault(peer, OrderedDict())
            if len(mine) >= self.per_peer:
                victims.append(self._pop(_victim(mine), self._refusal(f"from {peer} ", self.per_peer, 1)))
            if len(self._all) >= self.total:
                victims.append(self._pop(_victim(self._all), self._refusal("", self.total, 0)))
            mine[entry] = None
            self._all[entry] = None
            self.evictions += len(victims)
        for victim in victims:  # outside the lock: an owner may close a socket
            victim.evict(victim.evicted)
        return entry

    def expire(self, seconds: float, refusal: Refusal) -> None:
        """Let go (``evict``) every entry waiting longer than ``seconds``: a hard deadline however it trickles."""
        victims: list[Stranger] = []
        limit = time.monotonic() - seconds
        with self._lock:
            while self._all and (oldest := next(iter(self._all))).started < limit:
                victims.append(self._pop(oldest, refusal))
        for victim in victims:
            victim.evict(victim.evicted)

    def remove(self, entry: Stranger) -> None:
        """Stop counting ``entry`` (no-op if it was let go or removed already)."""
        with self._lock:
            if entry in self._all:
                del self._all[entry]
                self._drop_from_peer(entry)

    def _pop(self, entry: Stranger, refusal: Refusal) -> Stranger:
        del self._all[entry]
        self._drop_from_peer(entry)
        entry.evicted = refusal
        return entry

    def _drop_from_peer(self, entry: Stranger) -> None:
        mine = self._by_peer[entry.peer]
        del mine[entry]
        if not mine:
            del self._by_peer[entry.peer]

    def _refusal(self, scope: str, limit: int, option: int) -> Refusal:
        return Refusal(EXHAUSTED, f"more than {limit} unauthenticated {self._what} {scope}at once "
                                  f"({self._options[option]} {limit}); the oldest was let go: authenticate "
                                  "as soon as you connect")


def _victim(entries: OrderedDict[Stranger, None]) -> Stranger:
    """The oldest entry that is quiet, else the oldest."""
    for entry in entries:
        if entry.quiet is not None and entry.quiet():
            return entry
    return next(iter(entries))


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` banked."""

    def __init__(self, rate: float, burst: float, clock=time.monotonic):
        self.rate, self.burst, self._clock = float(rate), float(burst), clock
        self.tokens, self._stamp = float(burst), clock()

    def take(self, amount: float = 1.0) -> bool:
        """Spend ``amount`` tokens if they are there; False (and nothing spent) if not."""
        now = self._clock()
        self.tokens = min(self.burst, self.tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        if self.tokens < amount:
            return False
        self.tokens -= amount
        return True

    def give(self, amount: float) -> None:
        """Return ``amount`` tokens taken earlier (never beyond ``burst``)."""
        self.tokens = min(self.burst, self.tokens + amount)

    def full(self) -> bool:
        """Whether it has refilled to ``burst``: then it is as good as a fresh one."""
        return self.tokens + (self._clock() - self._stamp) * self.rate >= self.burst


class Limits:
    """The coordinator's per-agent and server-wide limits (see CoordinatorConfig for each)."""

    def __init__(self, config: CoordinatorConfig, model_bytes: int, clock=time.monotonic):
        self.config = config
        self.model_bytes = model_bytes
        self._clock = clock
        self._joins = TokenBucket(config.max_joins_per_second, max(1.0, config.max_joins_per_second * 5), clock)
        self._calls: dict[str, int] = {}
        self._attempts: dict[str, tuple[int, int]] = {}  # agent -> (round, upload attempts in it)
        self._attempts_round = 0  # the newest round in _attempts
        self._bytes: dict[str, TokenBucket] = {}
        self._bytes_kept = 0  # buckets after the last sweep of refilled ones
        self._rpcs = 0
        self._downloads: asyncio.Semaphore | None = None

    def admit_join(self, agent_id: str, registry, members: int = 0) -> None:
        """Refuse a Join (a JoinPopulation of ``members``: one join) when joins come too fast or new agents would
        overfill the registry (after forgetting agents whose liveness expired)."""
        more = max(members, 1 if registry.get(agent_id) is None else 0)
        if len(registry) + more > self.config.max_agents:
            registry.expire()
            if len(registry) + more > self.config.max_agents:
                raise Refusal(EXHAUSTED, f"the coordinator already has {len(registry)} agents registered "
                                         f"(--max-agents {self.config.max_agents}); try again later")
        if not self._joins.take():
            raise Refusal(EXHAUSTED, f"too many joins (more than {self.config.max_joins_per_second:g}/s, "
                                     "--max-joins-per-second); back off and retry")

    @contextmanager
    def agent_call(self, agent_id: str) -> Iterator[None]:
        """Count one in-flight call of ``agent_id`` for its duration; refuse beyond the per-agent limit."""
        count = self._calls.get(agent_id, 0)
        if count >= self.config.max_calls_per_agent:
            raise Refusal(EXHAUSTED, f"agent {agent_id!r} already has {count} calls in flight "
                                     f"(--max-calls-per-agent {self.config.max_calls_per_agent}); "
                                     "finish or cancel one first")
        self._calls[agent_id] = count + 1
        try:
            yield
        finally:
            left = self._calls[agent_id] - 1
            if left:
                self._calls[agent_id] = left
            else:
                del self._calls[agent_id]

    @asynccontextmanager
    async def download_slot(self) -> AsyncIterator[None]:
        """Wait for one of the concurrent-download slots (each stream buffers about one chunk)."""
        if self._downloads is None:
            self._downloads = asyncio.Semaphore(self.config.max_concurrent_downloads)
        async with self._downloads:
            yield

    def start_upload(self, agent_id: str, round_id: int) -> None:
        """Count an upload attempt; an abandoned upload may be retried, but not without bound."""
        if round_id > self._attempts_round:  # earlier rounds' counts are moot: forget them
            self._attempts = {a: v for a, v in self._attempts.items() if v[0] >= round_id}
            self._attempts_round = round_id
        seen_round, attempts = self._attempts.get(agent_id, (round_id, 0))
        if seen_round != round_id:
            attempts = 0
        if attempts >= self.config.max_upload_attempts_per_round:
            raise Refusal(EXHAUSTED, f"agent {agent_id!r} already started {attempts} uploads in round {round_id} "
                                     f"(--max-upload-attempts {self.config.max_upload_attempts_per_round}); "
                                     "wait for the next task")
        self._attempts[agent_id] = (round_id, attempts + 1)

    def count_bytes(self, agent_id: str, nbytes: int) -> None:
        """Charge ``nbytes`` of upload data to the agent's byte-rate bucket (if a rate is set)."""
        rate = self.config.max_upload_bytes_per_second
        if rate is None:
            return
        bucket = self._bytes.get(agent_id)
        if bucket is None:
            if len(self._bytes) > 2 * self._bytes_kept + 64:  # amortized: forget buckets that refilled
                self._bytes = {a: b for a, b in self._bytes.items() if not b.full()}
                self._bytes_kept = len(self._bytes)
            # An update plus one retry may arrive at full speed; beyond that the agent is held to ``rate``.
            bucket = self._bytes[agent_id] = TokenBucket(rate, max(rate, 2.0 * self.model_bytes), self._clock)
        if not bucket.take(nbytes):
            raise Refusal(EXHAUSTED, f"agent {agent_id!r} is uploading faster than {rate:g} bytes/s "
                                     "(--max-upload-bytes-per-second); the update was not applied, retry later")

    def refund_bytes(self, agent_id: str, nbytes: int) -> None:
        """Give back bytes charged in advance (by a data-plane upload) that never arrived."""
        bucket = self._bytes.get(agent_id)
        if bucket is not None and nbytes > 0:
            bucket.give(nbytes)

    def enter_rpc(self) -> None:
        """Count one more call in flight server-wide; refuse beyond the concurrent-call limit."""
        if self._rpcs >= self.config.max_concurrent_rpcs:
            raise Refusal(EXHAUSTED, f"the coordinator already has {self._rpcs} calls in flight "
                                     f"(--max-concurrent-rpcs {self.config.max_concurrent_rpcs}); retry in a moment")
        self._rpcs += 1

    def exit_rpc(self) -> None:
        """A call counted by :meth:`enter_rpc` ended."""
        self._rpcs -= 1

    @property
    def in_flight(self) -> int:
        """Calls counted by :meth:`enter_rpc` that have not ended."""
        return self._rpcs

    def forget(self, agent_id: str) -> None:
        """Drop what is kept about an agent that left."""
        self._attempts.pop(agent_id, None)
        self._bytes.pop(agent_id, None)


class CallBudget:
    """Which budget one call holds: the strangers' (until it authenticates) or the honest one."""

    def __init__(self, limits: Limits, peer: str, identity: PeerIdentity | None = None):
        self.limits = limits
        self.peer = peer  # whom its strangers' bound is kept for
        self.identity = identity  # what its client certificate proves (None: none), read once for the whole call
        self.stranger: Stranger | None = None
        self.counted = False  # holds a --max-concurrent-rpcs place

    def enter(self) -> None:
        """Take a place in the honest budget (a Refusal naming --max-concurrent-rpcs when it is full)."""
        self.limits.enter_rpc()
        self.counted = True

    def authenticate(self) -> None:
        """The call proved who it is (or sent its request): leave the strangers' bounds for the honest budget."""
        if self.counted:
            return
        stranger = self.stranger
        if stranger is not None:
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


def call_identity(context) -> PeerIdentity | None:
    """What the running call's client certificate proves (None: none), as its budget read it at the call's start;
    read from ``context`` if the call is not counted."""
    budget = _CALL.get()
    return budget.identity if budget is not None else peer_identity(context)


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
    """Routes every call to the answering coordinator's methods (``answering``) and wraps each method handler in
    the revocation check and the budget it is counted in. ``tls``: whether the server's port is a TLS one (a
    plaintext port's calls prove no certificate: none is looked for). A port that changes coordinators
    (server/agent_port.py) sets ``answering``, ``limits`` and ``restoring`` as it does."""

    def __init__(self, limits: Limits, admission: Admission, strangers: StrangerBound, tls: bool = True):
        self.limits = limits
        self.admission = admission
        self.strangers = strangers
        self.answering: grpc.GenericRpcHandler | None = None  # fedpar's methods, as the answering coordinator's
        self.restoring = True  # while true, every call but health checks is refused (UNAVAILABLE: retry)
        self.tls = tls

    async def intercept_service(self, continuation, handler_call_details):
        """The method's handler, checked and counted (health checks: as strangers' calls, never authenticated)."""
        handler = await continuation(handler_call_details)  # the health service's, registered on the server
        if handler is None and self.answering is not None:
            handler = self.answering.service(handler_call_details)
        if handler is None:
            return None
        return self.counted(handler, stranger_only=handler_call_details.method.startswith(HEALTH_METHODS))

    async def _enter(self, context, stranger: bool, health_check: bool = False) -> CallBudget:
        """The call's budget, a stranger's from the start if ``stranger``; or an abort: a revoked certificate, or
        any call but a health check while the coordinator restores its checkpoint."""
        if not health_check and self.restoring:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the coordinator is restoring its checkpoint; "
                                                             "try again in a moment")
        identity = peer_identity(context) if self.tls else None
        if identity is not None:
            try:
                self.admission.check_peer(identity)
            except AdmissionRefused as exc:
                await context.abort(exc.code, exc.message)
        budget = CallBudget(self.limits, peer_key(context, identity), identity)
        if stranger:
            self._admit(budget)
        _CALL.set(budget)
        return budget

    def _admit(self, budget: CallBudget, let_go: Callable[[Refusal], None] | None = None) -> None:
        """Count the running call in the strangers' bounds; if it is let go, ``let_go(refusal)`` is called (by
        default its task is cancelled)."""
        if let_go is None:
            task = asyncio.current_task()
            let_go = lambda _: task.cancel()  # noqa: E731
        budget.stranger = self.strangers.admit(budget.peer, let_go)

    async def _request(self, request_iterator, context, budget: CallBudget, authenticate: bool = True):
        """A unary call's one request, within --upload-header-seconds; it then leaves the strangers' bounds (a
        request that comes within REQUEST_GRACE_SECONDS never entered them). The read is never cancelled (that
        disturbed other calls' reads under a flood): a call let go or out of time is aborted, which ends it."""
        seconds = self.limits.config.upload_header_seconds
        coming = asyncio.ensure_future(request_iterator.__anext__())
        coming.add_done_callback(retrieved)  # it ends with an error once the call is aborted
        await asyncio.wait((coming,), timeout=min(seconds, REQUEST_GRACE_SECONDS))
        if not coming.done() and budget.stranger is None:  # late: a stranger's call until its request comes
            let_go = asyncio.get_running_loop().create_future()
            self._admit(budget, lambda refusal: let_go.done() or let_go.set_result(refusal))
            await asyncio.wait((coming, let_go), timeout=max(0.0, seconds - REQUEST_GRACE_SECONDS),
                               return_when=asyncio.FIRST_COMPLETED)
            if not coming.done() and let_go.done():
                refusal = let_go.result()
                await context.abort(refusal.code, refusal.message)
        if not coming.done():
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no request within {seconds:g} s of opening the call (--upload-header-seconds)")
        if coming.exception() is not None:  # StopAsyncIteration: it ended without one
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without its request")
        request = coming.result()
        if not authenticate:
            return request
        try:
            budget.authenticate()
        except Refusal as r:
            await context.abort(r.code, r.message)
        return request

    def counted(self, handler: grpc.RpcMethodHandler, stranger_only: bool = False) -> grpc.RpcMethodHandler:
        """``handler`` served as a request stream inside :meth:`_enter` and :meth:`CallBudget.release`;
        ``stranger_only``: the call counts in the strangers' bounds throughout and never authenticates."""
        serde = dict(request_deserializer=handler.request_deserializer,
                     response_serializer=handler.response_serializer)
        streams_in = handler.request_streaming
        authenticate = not stranger_only

        async def request_of(request_iterator, context, budget):
            if streams_in:
                return request_iterator
            return await self._request(request_iterator, context, budget, authenticate)

        if handler.response_streaming:
            behavior = handler.stream_stream if streams_in else handler.unary_stream
            if not inspect.isasyncgenfunction(behavior):  # it answers with context.write (grpc_health's Watch)
                async def writing(request_iterator, context):
                    budget = await self._enter(context, streams_in or stranger_only, stranger_only)
                    try:
                        await behavior(await request_of(request_iterator, context, budget), context)
                    except asyncio.CancelledError:
                        await _evicted(budget, context)
                    finally:
                        budget.release()
                return grpc.stream_stream_rpc_method_handler(writing, **serde)

            async def streaming(request_iterator, context):
                budget = await self._enter(context, streams_in or stranger_only, stranger_only)
                try:
                    request = await request_of(request_iterator, context, budget)
                    async for item in behavior(request, context):
                        yield item
                except asyncio.CancelledError:
                    await _evicted(budget, context)
                finally:
                    budget.release()
            return grpc.stream_stream_rpc_method_handler(streaming, **serde)

        behavior = handler.stream_unary if streams_in else handler.unary_unary

        async def unary(request_iterator, context):
            budget = await self._enter(context, streams_in or stranger_only, stranger_only)
            try:
                request = await request_of(request_iterator, context, budget)
                return await behavior(request, context)
            except asyncio.CancelledError:
                await _evicted(budget, context)
            finally:
                budget.release()
        return grpc.stream_unary_rpc_method_handler(unary, **serde)


def retrieved(future: asyncio.Future) -> None:
    """Mark a finished future's outcome as seen (asyncio would log an unretrieved exception)."""
    if not future.cancelled():
        future.exception()


async def _evicted(budget: CallBudget, context) -> None:
    """A cancelled call: abort with the strangers' bound that let it go, or let the cancellation go on."""
    stranger = budget.stranger
    if stranger is None or stranger.evicted is None:
        raise asyncio.CancelledError
    asyncio.current_task().uncancel()
    await context.abort(stranger.evicted.code, stranger.evicted.message)
