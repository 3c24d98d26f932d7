"""Runs a Coordinator behind a grpc.aio server on its own event-loop thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import ssl
import threading
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedpar.protocol.messages import SERVICE_NAME, channel_options
from fedpar.server.coordinator import Coordinator
from fedpar.server.dataplane import start_data_plane
from fedpar.server.ranks.group import RankMissing
from fedpar.server.limits import RpcLimit, StrangerBound
from fedpar.server.service import CoordinatorService, generic_handler

log = logging.getLogger("fedpar.server")


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


class RestoreError(ValueError):
    """The coordinator's checkpoint cannot be restored (damaged, or of another model); the message says why."""


class CoordinatorServer:
    """Serves the coordinator on ``host:port`` (port 0 picks a free one) from a background thread."""

    def __init__(self, coordinator: Coordinator, host: str = "127.0.0.1", port: int = 0,
                 credentials: grpc.ServerCredentials | None = None, data_tls: ssl.SSLContext | None = None):
        self.coordinator = coordinator
        self.host = host
        self.requested_port = port
        self.credentials = credentials
        self.data_tls = data_tls  # TLS for the data plane; required for it when ``credentials`` is set
        self.data_plane = None
        self.strangers: StrangerBound | None = None  # upload streams not yet authenticated (for tests and logs)
        self.port: int | None = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._grace = 1.0  # seconds calls in flight get when the server stops
        self.health: health.aio.HealthServicer | None = None  # grpc.health.v1 on the same port
        self.on_listening: Callable[[int], None] | None = None  # called with the port once health checks answer
        self.restoring = False  # the checkpoint is being restored: health says NOT_SERVING, other calls UNAVAILABLE

    @property
    def address(self) -> str:
        """``host:port`` agents should dial."""
        return f"{self.host}:{self.port}"

    def start(self) -> int:
        """Start serving and running rounds; returns the bound port."""
        self._thread = threading.Thread(target=self._thread_main, name="fedpar-coordinator", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error
        return self.port

    def wait(self, timeout: float | None = None) -> bool:
        """Block until all rounds are done (True) or ``timeout`` passes (False); re-raises round errors."""
        done = self._finished.wait(timeout)
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

    def stop(self, grace: float = 1.0) -> None:
        """Stop the gRPC server and the loop thread."""
        self._grace = grace
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=grace + 10)
        self.coordinator.close()

    async def _set_health(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING on grpc.health.v1, for the whole server and for fedpar's service."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def on_loop(self, fn, timeout: float = 1.0):
        """``fn()`` run on the coordinator's event loop from another thread (its state belongs to the loop); raises
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

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced to the caller through start()/wait()
            self.error = exc
            # Said in one line by the caller: a port, a checkpoint, a file that cannot be written (a full disk), or
            # a lost aggregator rank.
            if not isinstance(exc, (BindError, RestoreError, RankMissing)) and not (isinstance(exc, OSError)
                                                                                  and exc.errno):
                log.exception("coordinator stopped with an error")
        finally:
            self._ready.set()
            self._finished.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.set_exception_handler(_quiet_about_cancelled_calls)
        self._stop = asyncio.Event()
        config = self.coordinator.config
        service = CoordinatorService(self.coordinator)
        # RpcLimit: revocation at the first call, --max-concurrent-rpcs, and the bounds on unauthenticated streams.
        strangers = StrangerBound(config.max_unauthenticated_calls, config.max_unauthenticated_per_peer,
                                  "--max-unauthenticated-calls", "--max-unauthenticated-per-peer", "calls")
        self.strangers = strangers
        server = grpc.aio.server(options=server_options(config.max_chunk_bytes),
                                 interceptors=[RpcLimit(service.limits, self.coordinator.registry.admission,
                                                        strangers, restoring=lambda: self.restoring)])
        server.add_generic_rpc_handlers((generic_handler(service),))
        self.health = health.aio.HealthServicer()
        await self._set_health(False)  # until the coordinator serves rounds
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.coordinator.on_ready = lambda serving: asyncio.ensure_future(self._set_health(serving))
        target = f"{self.host}:{self.requested_port}"
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
        self.restoring = True
        await server.start()
        self.coordinator.grpc_port = self.port
        if self.on_listening is not None:
            self.on_listening(self.port)
        try:  # health checks are answered (NOT_SERVING) while the checkpoint is read
            await asyncio.to_thread(self.coordinator.restore)
        except ValueError as exc:
            await server.stop(0)
            raise RestoreError(str(exc)) from exc
        self.restoring = False
        self.data_plane = start_data_plane(self.coordinator, self._loop, self.host, self.credentials is not None,
                                           self.data_tls, service.intake)
        self._ready.set()
        rounds = asyncio.ensure_future(self.coordinator.run())
        stopper = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({rounds, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if rounds.done():
                if rounds.exception() is not None:
                    raise rounds.exception()
                self._finished.set()
                await stopper  # keep serving so agents hear "shutdown" until stop() is called
        finally:
            await self._set_health(False)
            rounds.cancel()
            stopper.cancel()
            if self.data_plane is not None:
                self.data_plane.stop()
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
