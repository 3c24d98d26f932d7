"""The agents' gRPC port: a grpc.aio server on an event-loop thread of its own, with grpc.health.v1 beside fedpar's
service, whose calls go to one coordinator at a time.

Coordinators are stacked on the port: each call goes to the topmost one that has restored its checkpoint (a call
that finds only one restoring is refused UNAVAILABLE, so the agent retries). A one-shot coordinator has a port of its
own; a long-lived service keeps one port for its life, its idle coordinator at the bottom and each run's on top of it
while the run lasts. Coordinators given one member source (server/members.py) share its agents and their sessions, so
agents stay joined, and the port bound and SERVING, from run to run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedpar.parallel.stopping import wait_awake
from fedpar.protocol.codec import SERVICE_NAME, channel_options, grpc_target
from fedpar.security.admission import Admission
from fedpar.server.config import CoordinatorConfig
from fedpar.server.limits import Limits, RpcLimit, StrangerBound

log = logging.getLogger("fedpar.server")
DRAIN_POLL_SECONDS = 0.02  # how often a coordinator handed over looks whether its calls in flight have ended


def server_options(max_chunk_bytes: int) -> list[tuple[str, int]]:
    """Channel options plus the keepalive permissions agents' pings need."""
    return channel_options(max_chunk_bytes) + [
        # GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS: agents ping every 30 s, also on idle channels
        # (an aggregator rank's between rounds); under gRPC's 5-minute default such pings end in GOAWAY
        # "too_many_pings".
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.max_concurrent_streams", 4096),
        # gRPC core cancels calls beyond 1,000 (soft) and 3,000 (hard) not yet handed to a handler: a burst of
        # strangers' calls got honest agents' calls cancelled before fedpar's own bounds (which let the oldest
        # stranger go instead) could see them.
        ("grpc.server.max_pending_requests", 1 << 16),
        ("grpc.server.max_pending_requests_hard_limit", 1 << 17),
        # gRPC sets SO_REUSEPORT by default, so a second coordinator on a port in use would share it silently.
        ("grpc.so_reuseport", 0),
    ]


class BindError(OSError):
    """The coordinator could not listen on its address (the port is in use, or the host is not this machine's)."""


@dataclass(eq=False)
class Stacked:
    """One coordinator on the port: its method handlers and limits, and whether it still restores its checkpoint."""

    coordinator: object  # an IngestPlane (server/ranks/plane.py): the Coordinator, or another aggregator rank
    handler: grpc.GenericRpcHandler
    limits: Limits
    restoring: bool = True
    taking: bool = False  # calls go to it now (told by ``taking_calls``; ``hand_over`` when they no longer do)
    ready: bool = False  # serving rounds (or idling for the next run): health says SERVING while one is


class AgentPort:
    """``host:port`` (0 picks a free one) for the coordinators stacked on it, served from a background thread;
    ``config`` and ``admission``: the limits and the admission policy every call there is held to."""

    def __init__(self, config: CoordinatorConfig, admission: Admission | None = None, host: str = "127.0.0.1",
                 port: int = 0, credentials: grpc.ServerCredentials | None = None):
        self.config, self.admission = config, admission or Admission()
        self.host, self.requested_port, self.credentials = host, port, credentials
        self.port: int | None = None
        # RpcLimit: revocation at the first call, --max-concurrent-rpcs, and the bounds on unauthenticated streams.
        self.strangers = StrangerBound(config.max_unauthenticated_calls, config.max_unauthenticated_per_peer,
                                       "--max-unauthenticated-calls", "--max-unauthenticated-per-peer", "calls")
        self.on_listening: Callable[[int], None] | None = None  # called with the port once health checks answer
        self.answering: Stacked | None = None  # the coordinator calls go to; kept when the last one leaves the stack
        self.health: health.aio.HealthServicer | None = None
        self._stack: list[Stacked] = []
        # its limits are the answering coordinator's (``_choose``); these stand in until the first is pushed
        self._limit = RpcLimit(Limits(config, 0), self.admission, self.strangers, tls=credentials is not None)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._started = False  # the server answers calls: from the first push
        self._thread: threading.Thread | None = None
        self._opened = threading.Event()
        self._closing: asyncio.Event | None = None
        self._grace = 1.0  # seconds calls in flight get when the port closes
        self.error: BaseException | None = None

    def open(self) -> int:
        """Bind the port (the first coordinator pushed starts serving it); returns the port, or raises BindError."""
        self._thread = threading.Thread(target=self._thread_main, name="fedpar-coordinator", daemon=True)
        self._thread.start()
        wait_awake(self._opened)
        if self.error is not None:
            raise self.error
        return self.port

    def close(self, grace: float = 1.0) -> None:
        """Stop serving, giving calls in flight ``grace`` seconds, and end the loop thread."""
        self._grace = grace
        loop = self._loop
        if loop is not None and self._closing is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._closing.set)
        if self._thread is not None:
            self._thread.join(timeout=grace + 10)

    def submit(self, coroutine) -> concurrent.futures.Future:
        """Run ``coroutine`` on the port's loop (RuntimeError when the port is not open)."""
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running():
            coroutine.close()
            raise RuntimeError("the coordinator is not running")
        return asyncio.run_coroutine_threadsafe(coroutine, loop)

    def on_loop(self, fn, timeout: float = 1.0):
        """``fn()`` run on the port's event loop from another thread (the coordinators' state belongs to it); raises
        RuntimeError when the loop is not running, TimeoutError when it does not answer in ``timeout`` s."""
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running():
            raise RuntimeError("the coordinator is not running")
        done: concurrent.futures.Future = concurrent.futures.Future()

        def call():
            try:
                done.set_result(fn())
            except BaseException as exc:
                done.set_exception(exc)
        loop.call_soon_threadsafe(call)
        return done.result(timeout)

    # ----------------------------------------------------------------- the stack (on the loop)
    async def push(self, coordinator, handler: grpc.GenericRpcHandler, limits: Limits) -> Stacked:
        """Put ``coordinator`` on top, restoring: calls go on to the one beneath until :meth:`restored` (with none
        beneath, they are refused UNAVAILABLE: the first one pushed starts the server, health NOT_SERVING)."""
        entry = Stacked(coordinator, handler, limits)
        coordinator.grpc_port = self.port
        coordinator.on_ready = lambda serving: self._ready(entry, serving)
        self._stack.append(entry)
        self._choose()
        if not self._started:
            self._started = True
            await self._server.start()
            if self.on_listening is not None:
                try:  # e.g. a --port-file that cannot be written: the caller ends with it
                    self.on_listening(self.port)
                except BaseException:
                    self._stack.remove(entry)
                    self._choose()
                    raise
        return entry

    def restored(self, entry: Stacked) -> None:
        """``entry``'s checkpoint is restored: calls go to it (if it is on top) from now on."""
        entry.restoring = False
        self._choose()

    async def pop(self, entry: Stacked, grace: float) -> None:
        """Take ``entry`` off the stack; if another coordinator answers now, give ``entry``'s calls in flight up to
        ``grace`` seconds to end."""
        self._stack.remove(entry)
        self._ready(entry, False)
        self._choose()
        if self.answering is entry:
            return
        end = time.monotonic() + grace
        while entry.limits.in_flight and time.monotonic() < end:
            await asyncio.sleep(DRAIN_POLL_SECONDS)

    def _choose(self) -> None:
        """Calls go to the topmost coordinator that has restored (else to the top one, which refuses them); with
        none left on the stack, to the last one until the port closes. One that stops taking them hands over."""
        if not self._stack:
            return
        answering = next((e for e in reversed(self._stack) if not e.restoring), self._stack[-1])
        before, self.answering = self.answering, answering
        self._limit.limits, self._limit.answering, self._limit.restoring = (answering.limits, answering.handler,
                                                                            answering.restoring)
        if before is not None and before is not answering and before.taking:
            before.taking = False
            before.coordinator.hand_over()
        if not answering.restoring and not answering.taking:
            answering.taking = True
            answering.coordinator.taking_calls()

    def _ready(self, entry: Stacked, serving: bool) -> None:
        entry.ready = serving
        asyncio.ensure_future(self._set_health(any(e.ready for e in self._stack)))

    async def _set_health(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING on grpc.health.v1, for the whole server and for fedpar's service."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    # ----------------------------------------------------------------- the loop thread
    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # a port that cannot be bound: surfaced to the caller through open()
            self.error = exc
        finally:
            self._opened.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.set_exception_handler(_quiet_about_cancelled_calls)
        self._closing = asyncio.Event()
        server = self._server = grpc.aio.server(options=server_options(self.config.max_chunk_bytes),
                                                interceptors=[self._limit])
        self.health = health.aio.HealthServicer()
        await self._set_health(False)  # until a coordinator serves
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        target = grpc_target(self.host, self.requested_port)
        try:
            if self.credentials is None:
                if self.host not in ("127.0.0.1", "localhost", "::1"):
                    log.warning("serving PLAINTEXT gRPC on %s: traffic and agent identities are unprotected", target)
                self.port = server.add_insecure_port(target)
            else:
                self.port = server.add_secure_port(target, self.credentials)
        except RuntimeError as exc:  # gRPC says only "Failed to bind"
            raise BindError(f"cannot listen on {target}: the port is in use or the address is not this "
                            "machine's") from exc
        self._opened.set()
        try:
            await self._closing.wait()
        finally:
            await self._set_health(False)
            await server.stop(self._grace)
            # gRPC's call tasks end by themselves once the server has stopped; the ones asyncio.run would cancel
            # on the way out print a CancelledError traceback of gRPC's own on stderr.
            others = asyncio.all_tasks() - {asyncio.current_task()}
            if others:
                await asyncio.wait(others, timeout=0.5)


def _quiet_about_cancelled_calls(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The loop's exception handler: a call cancelled as the server stops (gRPC's RPC tasks end that way on Ctrl-C)
    is no error worth a traceback; everything else goes to asyncio's default handler."""
    if isinstance(context.get("exception"), asyncio.CancelledError):
        log.debug("a call was cancelled as the coordinator stopped: %s", context.get("message"))
        return
    loop.default_exception_handler(context)
