"""The client agent: dials out to the coordinator, trains locally on each task, uploads in time."""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import ssl
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator

import grpc
import numpy as np

from fedpar.client import dataplane
from fedpar.client.backoff import RETRYABLE, Backoff, jittered
from fedpar.client.reconnect import FatalAgentError, Reconnecting
from fedpar.client.compressed import PreparedUpload, UpdateCompressor
from fedpar.client.privacy import privatize_update
from fedpar.client.round_modes import CompressedUpload, PlainUpload, SecureUpload, upload_timeout
from fedpar.client.stats import AgentStats
from fedpar.client.task_trainer import TaskTrainer
from fedpar.models import get_weights, set_weights, weight_specs
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.stubs import CoordinatorStub
from fedpar.protocol.codec import CodecError, ModelLayout
from fedpar.protocol.messages import DEFAULT_CHUNK_BYTES, PROTOCOL_VERSION, SMALL_UPDATE_BYTES, channel_options
from fedpar.protocol.task_settings import TaskSettings
from fedpar.security.handshake import diagnose_handshake, tls_mismatch
from fedpar.security.tls import TlsFiles
from fedpar.client.transfer import (UPLOAD_RETRYABLE, download_weights, ingest_address, small_upload, task_weights,
                                     upload_header, upload_messages, upload_update)
from fedpar.client.secure_upload import SecureSession

log = logging.getLogger("fedpar.client")
DATA_PLANE_BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]

UPLOAD_TO_DOWNLOAD = 1.2  # an agent expects its upload to take this many times its download
UPLOAD_MARGIN_SECONDS = 0.25  # ... and keeps this much more free before the deadline


@dataclass
class AgentConfig:
    """How an agent reaches its coordinator and paces itself."""

    server: str
    agent_id: str
    poll_seconds: float = 5.0  # long-poll wait per PullTask
    initial_backoff: float = 0.5
    max_backoff: float = 30.0
    give_up_after: float | None = None  # seconds without reaching the coordinator; None: never
    upload_margin_seconds: float = UPLOAD_MARGIN_SECONDS  # kept free before the deadline beyond the upload estimate
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    credentials: grpc.ChannelCredentials | None = None  # TLS (mTLS with a client certificate) for every channel
    insecure: bool = False  # a plaintext channel instead: only asked for explicitly (loopback, tests)
    tls_server_name: str | None = None  # name to check the coordinator's certificate for, if not the host
    enrollment_token: str = ""  # for coordinators that admit agents without certificates by token
    drop_probability: float = 0.0  # simulations: chance of vanishing for a round after training
    seed: int | None = None  # drop decisions and backoff jitter; None: fresh entropy (agents must not move in lockstep)
    data_plane: bool = True  # move weights over the coordinator's data plane when a task offers it
    data_tls: ssl.SSLContext | None = None  # TLS for the data plane; without it a TLS agent keeps to gRPC
    tls_files: TlsFiles | None = None  # the PEM files behind ``credentials``: to say why a handshake fails

    def __post_init__(self) -> None:
        """ValueError unless the channel's security is said: credentials for TLS, or insecure=True for plaintext."""
        if self.credentials is None and not self.insecure:
            raise ValueError("AgentConfig has no credentials: pass credentials=... (grpc.ssl_channel_credentials) for "
                             "TLS, or insecure=True for a plaintext channel (loopback and tests only)")
        if self.credentials is not None and self.insecure:
            raise ValueError("AgentConfig: credentials and insecure=True contradict each other; drop one")


def trainer_specs(trainer) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of what the trainer trains: its ``array_specs()`` if it has no torch ``.model``."""
    return trainer.array_specs() if hasattr(trainer, "array_specs") else weight_specs(trainer.model)


def load_arrays(trainer, arrays: list[np.ndarray]) -> None:
    """Give the trainer the round's global weights (``set_arrays``, or into its torch model)."""
    if hasattr(trainer, "set_arrays"):
        trainer.set_arrays(arrays)
    else:
        set_weights(trainer.model, arrays)


def trainer_arrays(trainer) -> list[np.ndarray]:
    """The trainer's weights after training (``get_arrays``, or its torch model's)."""
    return trainer.get_arrays() if hasattr(trainer, "get_arrays") else get_weights(trainer.model)


class Agent:
    """One federated participant: the pull loop around a trainer, a :class:`TaskTrainer` (or LocalTrainer, the
    zoo's kind of it).

    Any trainer with TaskTrainer's ``warm_up``, ``num_examples``, ``holding_task``, ``train`` and ``evaluate``
    will do; one without a torch ``.model`` provides ``array_specs()``, ``set_arrays()`` and ``get_arrays()``
    instead (client/flower_client.py), and one with ``reads_task_settings`` gets the task's settings in ``train``.
    """

    def __init__(self, config: AgentConfig, trainer: TaskTrainer):
        self.config = config
        self.trainer = trainer
        self.layout = ModelLayout(trainer_specs(trainer))
        self.stats = AgentStats()
        # How a small update is sent (a simulation host batches its seats' updates: simulations/host_uploads.py)
        self.send_small: Callable[[CoordinatorStub, pb.SmallUpload, float], pb.UploadReply] = _upload_small
        # Updates of fewer bytes go whole, in one message, without waiting for admission (a host that batches its
        # seats' updates takes whole ones up to a chunk: its batch call carries them anyway)
        self.small_below = SMALL_UPDATE_BYTES
        self.compression = UpdateCompressor(self.layout, seed=zlib.crc32(f"{config.seed}:{config.agent_id}".encode()))
        self._rng = random.Random(config.seed)
        self._auth: pb.AgentAuth | None = None
        self._heartbeat_seconds = 5.0
        self._max_chunk = max(config.chunk_bytes, DEFAULT_CHUNK_BYTES)
        self._stop = threading.Event()
        self._channel = self._open_channel(config.server)
        self._stub = CoordinatorStub(self._channel)
        self._ingest: dict[str, tuple[grpc.Channel, CoordinatorStub]] = {}  # aggregator ranks' channels by address
        self._finished_task_id = ""  # told to the coordinator, which then never hands that task out again
        self._heartbeat = _Heartbeat(self._send_heartbeat, lambda: self._heartbeat_seconds)
        self._calls = Reconnecting(config.agent_id, config.server, self._join, config.initial_backoff,
                                   config.max_backoff, self._rng, config.give_up_after, self._stop.is_set,
                                   self._check_tls, self._count_reconnect)

    def _open_channel(self, address: str) -> grpc.Channel:
        options = channel_options(64 << 20)
        if self.config.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.config.tls_server_name))
        if self.config.credentials is not None:
            return grpc.secure_channel(address, self.config.credentials, options=options)
        return grpc.insecure_channel(address, options=options)

    def ingest_stub(self, task: pb.TrainTask) -> CoordinatorStub:
        """The stub for the task's download and upload (one channel per aggregator rank, kept open)."""
        address = ingest_address(self.config.server, task)
        if address == self.config.server:
            return self._stub
        if address not in self._ingest:
            channel = self._open_channel(address)
            self._ingest[address] = (channel, CoordinatorStub(channel))
        return self._ingest[address][1]

    def stop(self) -> None:
        """Ask the agent to leave after its current step."""
        self._stop.set()

    def close(self) -> None:
        """Stop the heartbeat thread and close the channel."""
        self._heartbeat.close()
        self._channel.close()
        for channel, _ in self._ingest.values():
            channel.close()

    # ------------------------------------------------------------------ main loop
    def run(self) -> AgentStats:
        """Join, then pull and run tasks until the coordinator says shutdown (or :meth:`stop`)."""
        try:
            self.trainer.warm_up()
            self._calls.join()
            while not self._stop.is_set():
                reply = self._calls.call(self._pull)
                kind = reply.WhichOneof("kind")
                if kind == "shutdown_reason":
                    log.info("%s: coordinator says: %s", self.config.agent_id, reply.shutdown_reason)
                    break
                if kind == "task":
                    with self.trainer.holding_task(reply.task.round):
                        finished = self._run_task(reply.task)
                    if finished:
                        self._finished_task_id = reply.task.task_id
            return self.stats
        finally:
            self.close()

    def _count_reconnect(self) -> None:
        self.stats.reconnects += 1

    def _check_tls(self) -> str | None:
        """What TLS has to do with an unreachable coordinator (gRPC says only UNAVAILABLE): a TLS setting that
        differs from ours is returned, to be said in each retry line (its operator may restart it with ours); a
        wrong CA, a name mismatch or a refused certificate, which retrying does not cure, is a FatalAgentError."""
        mismatch = tls_mismatch(self.config.server, self.config.credentials is None)
        if mismatch is not None or self.config.credentials is None or self.config.tls_files is None:
            return mismatch
        problem = diagnose_handshake(self.config.server, self.config.tls_files, self.config.tls_server_name)
        if problem is not None:
            raise FatalAgentError(f"{self.config.agent_id}: {problem}")
        return None

    def _join(self) -> None:
        reply = self._stub.Join(pb.JoinRequest(agent_id=self.config.agent_id,
                                               num_examples=self.trainer.num_examples,
                                               capabilities={"framework": getattr(self.trainer, "framework",
                                                                                  "torch")},
                                               protocol_version=PROTOCOL_VERSION,
                                               enrollment_token=self.config.enrollment_token), timeout=30)
        self._auth = pb.AgentAuth(agent_id=self.config.agent_id, token=reply.token)
        self._heartbeat_seconds = reply.heartbeat_seconds or 5.0
        self._max_chunk = reply.max_chunk_bytes or DEFAULT_CHUNK_BYTES

    def _pull(self) -> pb.PullTaskReply:
        return self._stub.PullTask(pb.PullTaskRequest(auth=self._auth, wait_seconds=self.config.poll_seconds,
                                                      finished_task_id=self._finished_task_id),
                                   timeout=self.config.poll_seconds + 30)

    def _send_heartbeat(self) -> None:
        self._stub.Heartbeat(pb.HeartbeatRequest(auth=self._auth), timeout=self._heartbeat_seconds)

    def run_task_as(self, auth: pb.AgentAuth, task: pb.TrainTask, max_chunk_bytes: int = 0,
                    weights: list[np.ndarray] | None = None, mode: SecureUpload | None = None) -> bool:
        """Run one task for another identity (a virtual client whose host pulled the task): its session ``auth``
        on this agent's channel and trainer (whose data the caller set); ``weights``: the round's global model
        if the host has it already; ``mode``: the member's secure round, begun by its host. As :meth:`_run_task`."""
        self._auth = auth
        self._max_chunk = max_chunk_bytes or self._max_chunk
        with self.trainer.holding_task(task.round):
            return self._run_task(task, weights, mode)

    # ------------------------------------------------------------------ one task
    def _run_task(self, task: pb.TrainTask, weights: list[np.ndarray] | None = None,
                  mode: SecureUpload | None = None) -> bool:
        """Train on ``task`` and upload; False only if the task should be pulled again (its weights never came).
        ``weights``: the task's global weights when they are at hand already (nothing is downloaded); ``mode``:
        how its update goes up, when the caller made it (else as the task's settings say)."""
        received = time.monotonic()
        deadline_at = received + task.deadline_seconds
        self.stats.tasks += 1
        try:
            settings = TaskSettings.from_json(task.extra_json)
        except ValueError as err:
            self._note_refusal("task settings", err)
            return True
        data_plane = self._data_plane(task)
        mode = mode or self._round_mode(task, settings, deadline_at, data_plane)
        if not mode.begin():
            return True
        try:
            if weights is None:
                weights = task_weights(task, self.layout)  # small models come inside the task
            if weights is None and data_plane is not None:
                weights = self._via_data_plane("download", dataplane.download, data_plane, self.layout,
                                               max(1.0, task.deadline_seconds))
            if weights is None:
                weights = download_weights(self.ingest_stub(task), self._auth, task, self.layout, self._max_chunk,
                                           timeout=max(1.0, task.deadline_seconds))
        except (grpc.RpcError, CodecError, dataplane.DataPlaneRefused) as err:
            self._note_refusal("download", err)
            if isinstance(err, grpc.RpcError) and err.code() in RETRYABLE:
                # The coordinator hands the task out again until a download completes: pull after a pause.
                time.sleep(jittered(self.config.initial_backoff, self._rng))
                return False
            return True
        download_seconds = time.monotonic() - received
        load_arrays(self.trainer, weights)
        metrics: dict[str, float] = {}
        evaluation = self.trainer.evaluate() if settings.evaluate else None
        if evaluation is not None:
            metrics.update(evaluation.as_metrics())  # what was measured, and finite (a Flower client's may lack some)
        # Uploading takes about as long as downloading did; keep that and a margin free.
        stop_at = deadline_at - UPLOAD_TO_DOWNLOAD * download_seconds - self.config.upload_margin_seconds
        with self._heartbeat.while_training():
            extra = {"max_steps": task.max_steps} if task.max_steps else {}  # the virtual clock's cap (a TaskTrainer's)
            if getattr(self.trainer, "reads_task_settings", False):  # e.g. a Flower client's fit config
                extra["settings"] = settings
            result = self.trainer.train(task.local_epochs, task.batch_size, task.learning_rate, stop_at=stop_at,
                                        proximal_mu=settings.proximal_mu or 0.0, round_id=task.round, **extra)
        if result.examples == 0:
            log.warning("%s: no time left to train in round %d; skipping the upload", self.config.agent_id,
                        task.round)
            return True
        if self.config.drop_probability and self._rng.random() < self.config.drop_probability:
            self.stats.dropped += 1
            return True
        metrics.update(result.as_metrics())  # a NaN loss (e.g. a Flower client's fit that reports none) is left out
        if mode.upload(trainer_arrays(self.trainer), weights, result, metrics):
            self.stats.accepted += 1
            mode.close()
        return True

    def _round_mode(self, task: pb.TrainTask, settings: TaskSettings, deadline_at: float,
                    data_plane: dataplane.DataPlaneTarget | None) -> PlainUpload | SecureUpload:
        """How this task's update is made and sent, as its settings say (client/round_modes.py)."""
        if settings.secure_aggregation:
            return SecureUpload(SecureSession(self._stub, self._auth, task, self.config.poll_seconds), self.layout,
                                min(self._max_chunk, self.config.chunk_bytes), deadline_at, self._note_refusal)
        send = functools.partial(self._upload, task, deadline_at=deadline_at, data_plane=data_plane)
        if settings.compression != "none":
            return CompressedUpload(settings, self.layout, send, privatize_update, self._note_refusal,
                                    self.compression)
        return PlainUpload(settings, self.layout, send, privatize_update, self._note_refusal)

    def _upload(self, task: pb.TrainTask, upload: PreparedUpload, result, metrics: dict[str, float], *,
                deadline_at: float, data_plane: dataplane.DataPlaneTarget | None) -> bool:
        """Send the prepared update: over the data plane (plain weights only; compressed updates are small) or
        the gRPC stream, retried while the coordinator says it is busy and the deadline allows; True if accepted."""
        backoff = Backoff(0.1, 2.0, self._rng)
        while data_plane is not None and not upload.encoding:  # leaves for gRPC only if the connection broke
            try:
                if self._via_data_plane("upload", dataplane.upload, data_plane, self._auth, task, self.layout,
                                        upload.arrays, result.examples, result.steps, metrics,
                                        upload_timeout(deadline_at)) is None:
                    break
                return True
            except dataplane.DataPlaneRefused as err:
                # RESOURCE_EXHAUSTED: busy (upload queue) or rate-limited; retry while the deadline allows.
                if err.code != DATA_PLANE_BUSY or not backoff.fits_before(deadline_at):
                    self._note_refusal("upload", err)
                    return False
                time.sleep(backoff.wait())
        backoff.reset()
        header = upload_header(self._auth, task, upload.layout, result.examples, result.steps, metrics,
                               upload.encoding, upload.encoding_json)
        single = small_upload(header, upload.layout, upload.arrays, self._max_chunk, self.small_below)
        stub = self.ingest_stub(task)
        while True:
            messages = upload_messages(self._auth, task, upload.layout, upload.arrays, result.examples, result.steps,
                                       metrics, min(self._max_chunk, self.config.chunk_bytes), upload.encoding,
                                       upload.encoding_json)
            try:
                if single is not None:  # one unary call: no stream to set up for a small update
                    send = self.send_small if not task.ingest_port else _upload_small  # hooks: this port only
                    send(stub, single, upload_timeout(deadline_at))
                else:
                    upload_update(stub, messages, timeout=upload_timeout(deadline_at))
                return True
            except grpc.RpcError as err:
                # Busy coordinator or a broken connection: retry while the deadline allows.
                if err.code() not in UPLOAD_RETRYABLE or not backoff.fits_before(deadline_at):
                    self._note_refusal("upload", err)
                    return False
                time.sleep(backoff.wait())

    def _data_plane(self, task: pb.TrainTask) -> dataplane.DataPlaneTarget | None:
        """Where to move this task's weights outside gRPC, or None (not offered, off, or no TLS for it)."""
        if not (self.config.data_plane and dataplane.DataPlaneTarget.offered(task)):
            return None
        if self.config.credentials is not None and self.config.data_tls is None:
            return None  # never send weights in plaintext beside a TLS control channel
        return dataplane.DataPlaneTarget(ingest_address(self.config.server, task), task, self.config.data_tls,
                                         self.config.tls_server_name)

    def _via_data_plane(self, what: str, fn, *args):
        """``fn(*args)``, or None after a transport failure (the caller then uses the gRPC stream)."""
        try:
            return fn(*args)
        except dataplane.DataPlaneError as err:
            log.info("%s: data-plane %s failed (%s); using the gRPC stream", self.config.agent_id, what, err)
            return None

    def _note_refusal(self, what: str, err: Exception) -> None:
        detail = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.RpcError) else str(err)
        if isinstance(err, dataplane.DataPlaneRefused):
            detail = dataplane.refusal_text(err)
        self.stats.refused += 1
        self.stats.refusals.append(f"{what}: {detail}")
        log.info("%s: %s refused: %s", self.config.agent_id, what, detail)


def _upload_small(stub: CoordinatorStub, message: pb.SmallUpload, timeout: float) -> pb.UploadReply:
    """Send one small update in one UploadSmall call."""
    return stub.UploadSmall(message, timeout=timeout)


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
