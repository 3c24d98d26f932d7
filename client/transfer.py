"""Moving weights over the wire from the agent's side: the chunked download, and how one task's update is made and
goes up.

The update's round mode says what is sent (the agent asks it for every task, client/runtime.py): ``upload(trained,
global_weights, result, metrics, ends_at)`` makes the update and sends it (True if accepted), over by ``ends_at``,
which the runtime asks of the agent's deadline rule (fedpar/task.py) as the upload starts; ``begin()`` runs when the
task arrives and ``close()`` after an accepted upload. :class:`PlainUpload` sends the new weights and
:class:`CompressedUpload` their delta encoded as the task asks, both after client-side DP when the task asks for it;
the secure round's mode is client/secure_upload.py's (a masked vector inside the SecAgg+ stages).
:class:`UpdateSender` sends what a mode made over gRPC: one call when small, else a stream; retried while the
deadline allows.

Client-side differential privacy (:func:`privatize_update`) clips this agent's update (and optionally adds local
noise) before upload. The coordinator asks for it through the task's settings: ``dp_clip_norm`` (whole-model L2
bound ``C`` on ``new - global``) and ``dp_local_noise`` (local noise multiplier ``s``: each coordinate of the
clipped update gets ``N(0, (s C)^2)``, i.e. local DP, with fresh OS entropy). The central noise is added by the
coordinator, which also checks that the update really is within ``C``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import grpc
import numpy as np

from fedpar.aggregation.clipping import clip_update
from fedpar.client.backoff import Backoff, Uniform, sleep_unless
from fedpar.client.compressed import PreparedUpload, UpdateCompressor
from fedpar.client.model_fit import fitting_layout
from fedpar.client.trainer_protocol import UpdateRefused
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import (DP_CLIPPED, FRAMING_BYTES, NO_RUN_IN_PROGRESS, SMALL_UPDATE_BYTES, UPLOAD_ADMITTED,
                                   CodecError, CoordinatorStub, ModelLayout, RawData, TensorAssembler,
                                   encode_data_message, first_non_finite, iter_chunks, layout_from_pb, layout_to_pb,
                                   one_line, wire_bytes)
from fedpar.protocol.task_settings import TaskSettings

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # only named: the stacked rows and results come from a trainer
    from fedpar.client.local_loop import StackRow, TrainResult

# An upload refused with these may be sent again this round (busy coordinator, connection lost mid-stream).
UPLOAD_RETRYABLE = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})
ABANDON_CHECK_SECONDS = 0.5  # how often an upload in flight asks whether its round is over


class RoundOver(Exception):
    """An upload given up in flight: its round ended meanwhile (another round began)."""


class RankGone(Exception):
    """An upload given up: the aggregator rank its task names refuses connections (its process is gone)."""


def ingest_address(server: str, task: pb.TrainTask) -> str:
    """Where a task's weights move: the aggregator rank it names, else ``server``, the coordinator dialed."""
    if not task.ingest_port:
        return server
    return f"{task.ingest_host or server.rpartition(':')[0]}:{task.ingest_port}"


def download_request(auth: pb.AgentAuth, task: pb.TrainTask) -> pb.DownloadRequest:
    """The DownloadWeights request for ``task``'s global weights."""
    return pb.DownloadRequest(auth=auth, round=task.round, task_id=task.task_id)


def download_weights(stub: CoordinatorStub, auth: pb.AgentAuth, task: pb.TrainTask,
                     expected: ModelLayout, max_chunk_bytes: int, timeout: float | None = None) -> list[np.ndarray]:
    """Fetch the round's global weights; they must match the local model's layout exactly."""
    receiver = WeightsReceiver(expected, max_chunk_bytes)
    for message in stub.DownloadWeights(download_request(auth, task), timeout=timeout):
        receiver.take(message)
    return receiver.weights()


class WeightsReceiver:
    """The global weights, assembled from a DownloadWeights stream message by message and checked on the way.

    No I/O here: the client runtime feeds it from a blocking stream.
    """

    def __init__(self, expected: ModelLayout | None, max_chunk_bytes: int):
        """Expect the model ``expected`` (None: take the layout the header announces) in chunks of at most
        ``max_chunk_bytes``."""
        self.expected = expected
        self.max_chunk_bytes = max_chunk_bytes
        self.assembler: TensorAssembler | None = None

    @property
    def layout(self) -> ModelLayout | None:
        """The layout the stream's header announced (None before it)."""
        return None if self.assembler is None else self.assembler.layout

    def take(self, message: pb.ModelChunk | RawData) -> None:
        """Add one message of the stream; CodecError if it is out of place or does not fit."""
        if isinstance(message, RawData):
            if self.assembler is None:
                raise CodecError("download did not start with a ModelHeader")
            self.assembler.write(message.offset, message.data)
            return
        kind = message.WhichOneof("part")
        if self.assembler is None:
            if kind != "header":
                raise CodecError("download did not start with a ModelHeader")
            layout = layout_from_pb(message.header.tensors) if self.expected is None else \
                matching_layout(message.header, self.expected)
            self.assembler = TensorAssembler(layout, self.max_chunk_bytes)
        elif kind == "data":
            self.assembler.write(message.data.offset, message.data.data)
        else:
            raise CodecError(f"unexpected {kind} in download")

    def weights(self) -> list[np.ndarray]:
        """The whole model, once the stream has ended; CodecError if it is incomplete or holds NaN/Inf."""
        if self.assembler is None or not self.assembler.complete:
            raise CodecError("download ended before the whole model arrived")
        return finite_weights(self.assembler)


def task_weights(task: pb.TrainTask, expected: ModelLayout) -> list[np.ndarray] | None:
    """The global weights carried inside ``task`` (small models), or None when they must be downloaded."""
    if not task.HasField("weights_header"):
        return None
    layout = matching_layout(task.weights_header, expected)
    if len(task.weights) != layout.total_bytes:
        raise CodecError(f"the task carries {len(task.weights)} bytes of weights; the model has {layout.total_bytes}")
    assembler = TensorAssembler(layout, max(1, layout.total_bytes))
    if task.weights:
        assembler.write(0, task.weights)
    return finite_weights(assembler)


def matching_layout(header: pb.ModelHeader, expected: ModelLayout) -> ModelLayout:
    """The layout ``header`` announces, which must be this agent's model (ModelMismatch naming the difference)."""
    return fitting_layout(layout_from_pb(header.tensors), expected)


def finite_weights(assembler: TensorAssembler) -> list[np.ndarray]:
    """The received global weights, refused (CodecError) if any holds NaN or Inf."""
    bad = assembler.first_non_finite()
    if bad is not None:
        raise CodecError(f"received tensor {bad!r} holds NaN or Inf")
    return assembler.arrays


def upload_header(auth: pb.AgentAuth, task: pb.TrainTask, layout: ModelLayout, num_examples: int, steps: int,
                  metrics: dict[str, float], encoding: str = "", encoding_json: str = "") -> pb.UploadHeader:
    """The header describing one update (``encoding``: its compression; empty: the new weights)."""
    return pb.UploadHeader(auth=auth, round=task.round, task_id=task.task_id, num_examples=num_examples, steps=steps,
                           tensors=layout_to_pb(layout), total_bytes=layout.total_bytes, metrics=metrics,
                           encoding=encoding, encoding_json=encoding_json)


class SmallUpdate:
    """One update small enough for one SmallUpload message, kept as its arrays until it must go on its own: a host
    sums plain ones into its partial straight from them (client/host_uploads.py), and encodes only the rest.
    ``rows``: where the arrays are one row of members' stacked weights (client/local_loop.StackRow), kept only if
    the arrays are that row's own."""

    def __init__(self, header: pb.UploadHeader, layout: ModelLayout, arrays: Sequence[np.ndarray],
                 rows: StackRow | None = None):
        held = sum(np.asarray(a).nbytes for a in arrays)
        if held != layout.total_bytes or len(arrays) != len(layout.tensors):
            raise CodecError(f"update arrays hold {held} bytes; their layout needs {layout.total_bytes}")
        self.header, self.layout, self.arrays = header, layout, list(arrays)
        self.rows = rows if rows is not None and rows.holds(self.arrays) else None
        data = 1 + _varint_bytes(layout.total_bytes) + layout.total_bytes if layout.total_bytes else 0
        self.size = pb.SmallUpload(header=header).ByteSize() + data  # the message's, without encoding it
        self._message: pb.SmallUpload | None = None

    @property
    def encoded(self) -> bool:
        """Whether the update was encoded to bytes (it went, or is going, on its own)."""
        return self._message is not None

    @property
    def message(self) -> pb.SmallUpload:
        """The update as one SmallUpload message (encoded on first use)."""
        if self._message is None:
            self._message = pb.SmallUpload(header=self.header, data=wire_bytes(self.arrays))
        return self._message


def _varint_bytes(n: int) -> int:
    return max(1, -(-n.bit_length() // 7))


def small_update(header: pb.UploadHeader, layout: ModelLayout, arrays: Sequence[np.ndarray], max_chunk_bytes: int,
                 small_below: int = SMALL_UPDATE_BYTES, rows: StackRow | None = None) -> SmallUpdate | None:
    """The update as a :class:`SmallUpdate` when it has fewer than ``small_below`` bytes and its message fits a
    chunk, else None (it is then streamed)."""
    if layout.total_bytes >= small_below or layout.total_bytes > max_chunk_bytes:
        return None
    update = SmallUpdate(header, layout, arrays, rows)
    return update if update.size <= max_chunk_bytes + FRAMING_BYTES // 2 else None


def small_upload(header: pb.UploadHeader, layout: ModelLayout, arrays: Sequence[np.ndarray],
                 max_chunk_bytes: int, small_below: int = SMALL_UPDATE_BYTES) -> pb.SmallUpload | None:
    """The update as one SmallUpload message when it has fewer than ``small_below`` bytes and fits a chunk, else
    None (it is then streamed)."""
    update = small_update(header, layout, arrays, max_chunk_bytes, small_below)
    return update.message if update is not None else None


def upload_messages(auth: pb.AgentAuth, task: pb.TrainTask, layout: ModelLayout, arrays: Sequence[np.ndarray],
                    num_examples: int, steps: int, metrics: dict[str, float],
                    chunk_bytes: int, encoding: str = "", encoding_json: str = "") -> Iterator[pb.UploadChunk | bytes]:
    """The UploadChunk stream for one update: header, data chunks (pre-encoded bytes), end marker.

    ``encoding``/``encoding_json`` name the compression of ``arrays`` (empty: they are the new weights).
    """
    yield pb.UploadChunk(header=upload_header(auth, task, layout, num_examples, steps, metrics, encoding,
                                              encoding_json))
    count = 0
    for offset, data in iter_chunks(arrays, chunk_bytes):
        count += 1
        yield encode_data_message(offset, data)
    yield pb.UploadChunk(end=pb.UploadEnd(total_bytes=layout.total_bytes, num_chunks=count))


def upload_update(stub: CoordinatorStub, messages: Iterator[pb.UploadChunk | bytes],
                  timeout: float | None = None, abandoned: Callable[[], bool] = lambda: False) -> pb.UploadReply:
    """Send an upload stream; raises grpc.RpcError with the coordinator's reason if refused (cancelled once
    ``abandoned()``: :func:`result_unless`).

    The header goes first; the data of an upload of SMALL_UPDATE_BYTES or more follows only once the
    coordinator admits it (UPLOAD_ADMITTED initial metadata), so a busy coordinator refuses it before any
    data is on the way.
    """
    gate = _AdmissionGate(iter(messages))
    call = stub.UploadUpdate.future(gate, timeout=timeout)
    gate.attach(call)
    return result_unless(call, abandoned)


def upload_small(stub: CoordinatorStub, update: SmallUpdate, timeout: float,
                 abandoned: Callable[[], bool] = lambda: False) -> pb.UploadReply:
    """Send one small update in one UploadSmall call (cancelled once ``abandoned()``: :func:`result_unless`)."""
    return result_unless(stub.UploadSmall.future(update.message, timeout=timeout), abandoned)


def result_unless(call: grpc.Future, abandoned: Callable[[], bool]):
    """``call``'s result, or grpc.FutureCancelledError once ``abandoned()`` (the round is over) cancelled it: an
    aggregator rank that stopped (SIGSTOP, a hung host) still accepts connections, and the upload waited for the
    round's deadline while the agent missed the rounds rank 0 went on with."""
    while True:
        try:
            return call.result(timeout=ABANDON_CHECK_SECONDS)
        except grpc.FutureTimeoutError:
            if abandoned():
                call.cancel()


# upload_small, or a host's batch (which takes ``abandoned`` and goes on: the host's batch thread ends its calls)
SendSmall = Callable[..., pb.UploadReply]


class UpdateSender:
    """How one task's update goes up over gRPC, fixed when the task's round mode is made (client/runtime.py): with
    ``auth``, to ``stub`` (the task's aggregator rank's, or the coordinator's); small ones in one message through
    ``send_small`` (:func:`upload_small`, or a host's batch: client/host_uploads.py), the rest as an UploadUpdate
    stream of ``chunk_bytes`` chunks; retried with jittered backoff (``rng``) while the coordinator is busy or
    unreachable and the task's deadline allows, unless ``superseded()`` (a task of another round came) or
    ``stopped()`` (the runtime was asked to stop: given up at once, in flight too).
    ``note_refusal(what, err)``: how a refusal is noted. ``rank``: the address of the aggregator rank ``stub``
    dials, when it is not the coordinator's (``server``): one that refuses connections is gone (its process died,
    or its service restarted with ranks on other ports), so no upload to it can count, and the update is given up
    at once; the agent's next pull, at ``server``, finds the coordinator (and joins again if it restarted)."""

    def __init__(self, auth: pb.AgentAuth, task: pb.TrainTask, stub: CoordinatorStub, send_small: SendSmall,
                 deadline_at: float, chunk_bytes: int, max_chunk: int, small_below: int, rng: Uniform,
                 note_refusal: Callable[[str, Exception], None], superseded: Callable[[], bool] = lambda: False,
                 stopped: Callable[[], bool] = lambda: False, rank: str | None = None, server: str = "",
                 give_up_after: float | None = None):
        self.auth, self.task, self.stub, self.send_small = auth, task, stub, send_small
        self.give_up_after = give_up_after  # --give-up-after: an unreachable coordinator's retries end then too
        self.rank, self.server = rank, server
        self.superseded = superseded  # a task of another round came: this one's round (or run) is over
        self.stopped = stopped
        self.deadline_at, self.chunk_bytes = deadline_at, chunk_bytes
        self.max_chunk, self.small_below = max_chunk, small_below  # what fits one SmallUpload (the coordinator's)
        self.rng, self.note_refusal = rng, note_refusal

    def send(self, upload: PreparedUpload, result: TrainResult, metrics: dict[str, float], ends_at: float) -> bool:
        """Send the prepared update, every call over by ``ends_at`` (a time.monotonic() value); True if accepted (a
        refusal is noted)."""
        header = upload_header(self.auth, self.task, upload.layout, result.examples, result.steps, metrics,
                               upload.encoding, upload.encoding_json)
        # kept as arrays: a host sums plain ones into its partial without encoding them (the stack's row, as is)
        single = small_update(header, upload.layout, upload.arrays, self.max_chunk, self.small_below,
                              rows=None if upload.encoding else result.rows)
        backoff: Backoff | None = None  # made at the first refusal to retry: most uploads go through at once
        said_unreachable, retry_until = False, self.deadline_at
        abandoned = lambda: self.stopped() or self.superseded()  # noqa: E731
        while True:
            try:
                if single is not None:  # one unary call: no stream to set up for a small update
                    self.send_small(self.stub, single, ends_at - time.monotonic(), abandoned=abandoned)
                else:
                    messages = upload_messages(self.auth, self.task, upload.layout, upload.arrays, result.examples,
                                               result.steps, metrics, self.chunk_bytes, upload.encoding,
                                               upload.encoding_json)
                    upload_update(self.stub, messages, timeout=ends_at - time.monotonic(), abandoned=abandoned)
                return True
            except grpc.FutureCancelledError:
                if not self._given_up_for_stop():
                    self.note_refusal("upload", RoundOver(f"round {self.task.round} is over (another round began): "
                                                          "not sent"))
                return False
            except grpc.RpcError as err:
                if run_ended(err):  # expected when a run is stopped: no refusal to count or alarm anyone with
                    log.info("%s: round %d's update was not used: its run ended (finished or stopped) before it "
                             "arrived", self.auth.agent_id, self.task.round)
                    return False
                if err.code() == grpc.StatusCode.UNAUTHENTICATED:  # the agent's next call joins again (Reconnecting)
                    log.info("%s: round %d's update was not used: the coordinator no longer knows this agent's "
                             "session (it restarted); joining again", self.auth.agent_id, self.task.round)
                    return False
                if self._given_up_for_stop():
                    return False
                if self.rank is not None and refuses_connections(err, self.rank):
                    self.note_refusal("upload", RankGone(
                        f"aggregator rank {self.rank} refuses connections (it stopped, or its service restarted): "
                        f"round {self.task.round}'s update is given up; back to the coordinator at {self.server}"))
                    return False
                # Busy coordinator or a broken connection: retry while the deadline allows.
                backoff = backoff or Backoff(0.1, 2.0, self.rng)
                if err.code() == grpc.StatusCode.UNAVAILABLE and not said_unreachable and self.give_up_after is not None:
                    retry_until = min(self.deadline_at, time.monotonic() + self.give_up_after)
                if err.code() not in UPLOAD_RETRYABLE or not backoff.fits_before(retry_until) or self.superseded():
                    self.note_refusal("upload", err)
                    return False
                if err.code() == grpc.StatusCode.UNAVAILABLE and not said_unreachable:
                    said_unreachable = True  # once an upload: the retries go on quietly until the deadline
                    log.info("%s: coordinator unreachable while uploading (%s); retrying until %s, %.0fs from now",
                             self.auth.agent_id, one_line(err.details() or ""),
                             "the round's deadline" if retry_until == self.deadline_at else "--give-up-after",
                             retry_until - time.monotonic())
                sleep_unless(backoff.wait(), self.stopped)

    def _given_up_for_stop(self) -> bool:
        """Whether the runtime was stopped, so the update is given up (said once, in the info log)."""
        if not self.stopped():
            return False
        log.info("%s: round %d's update was not sent: the agent is stopping", self.auth.agent_id, self.task.round)
        return True


def refuses_connections(err: grpc.RpcError, address: str) -> bool:
    """Whether ``err`` says that nothing listens at ``address`` (the TCP connection was refused), and a fresh
    connection there is refused too: not a busy or slow server, which answers or takes the connection, nor a rank
    started again on its port, which a channel still waiting out its reconnect backoff reports with the refusal it
    last saw, but a port nobody holds."""
    if err.code() != grpc.StatusCode.UNAVAILABLE or "connection refused" not in (err.details() or "").lower():
        return False
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
    except (OSError, ValueError):
        return True
    return False


def run_ended(err: grpc.RpcError) -> bool:
    """Whether ``err`` is a service's refusal of an update whose run ended (its coordinator between runs)."""
    return err.code() == grpc.StatusCode.FAILED_PRECONDITION and NO_RUN_IN_PROGRESS in (err.details() or "")


def waits_for_admission(first: pb.UploadChunk | bytes) -> bool:
    """Whether an upload starting with ``first`` holds its data back until the coordinator admits it."""
    return not (isinstance(first, pb.UploadChunk) and first.WhichOneof("part") == "header"
                and first.header.total_bytes < SMALL_UPDATE_BYTES)


class _AdmissionGate:
    """Request iterator that holds everything after the first message until the call is admitted."""

    def __init__(self, messages: Iterator):
        self._messages = messages
        self._sent_header = False
        self._admitted = False
        self._call = None
        self._attached = threading.Event()

    def attach(self, call) -> None:
        """Give the gate the call whose initial metadata it waits for."""
        self._call = call
        self._attached.set()

    def __iter__(self) -> "_AdmissionGate":
        return self

    def __next__(self):
        if not self._sent_header:
            self._sent_header = True
            header = next(self._messages)
            self._admitted = not waits_for_admission(header)
            return header
        if not self._admitted:
            self._attached.wait()
            metadata = self._call.initial_metadata() or ()  # blocks until admitted or refused
            if UPLOAD_ADMITTED not in tuple(metadata):
                raise StopIteration  # refused: the call ends with the coordinator's status
            self._admitted = True
        return next(self._messages)


# the agent's transport: (update, result, metrics, ends_at) -> True if accepted
Send = Callable[[PreparedUpload, "TrainResult", dict[str, float], float], bool]
NoteRefusal = Callable[[str, Exception], None]  # (what was refused, why)


def dp_settings(settings: TaskSettings | Mapping) -> tuple[float, float] | None:
    """``(clip_norm, local_noise_multiplier)`` requested by the task, or None when it asks for no clipping."""
    settings = TaskSettings.of(settings)
    if settings.dp_clip_norm is None:
        return None
    return settings.dp_clip_norm, settings.dp_local_noise or 0.0


def privatize_update(new_weights: Sequence[np.ndarray], global_weights: Sequence[np.ndarray],
                     dp: tuple[float, float] | None, rng: np.random.Generator | None = None
                     ) -> tuple[list[np.ndarray], bool | None]:
    """The weights to upload: ``new_weights`` with its delta from ``global_weights`` clipped (and noised) as ``dp``
    (:func:`dp_settings`) says; and whether the clip changed it (the clip bit the report carries; None: no DP)."""
    if dp is None:
        return list(new_weights), None
    clip, local_noise = dp
    clipped, norm = clip_update(new_weights, global_weights, clip)
    if local_noise > 0:
        rng = rng or np.random.default_rng()
        std = local_noise * clip
        clipped = [(w + std * rng.standard_normal(w.shape)).astype(w.dtype) for w in clipped]
    return clipped, norm > clip


class PlainUpload:
    """Plain rounds: the new weights go up in the clear (clipped, maybe noised, if the task asks for client DP)."""

    def __init__(self, settings: TaskSettings, layout: ModelLayout, send: Send):
        self.settings = settings
        self.dp = dp_settings(settings)  # client-side DP: (clip norm, local noise), or None
        self.layout = layout
        self.send = send

    def begin(self) -> bool:
        """Nothing to do before training."""
        return True

    def upload(self, trained: list[np.ndarray], global_weights: list[np.ndarray], result: TrainResult,
               metrics: dict[str, float], ends_at: float) -> bool:
        """Client-side DP as the task asks, then :meth:`prepare`, then the agent's transport, over by ``ends_at``;
        weights that training left NaN or Inf (a diverged run) are not sent: UpdateRefused, which the runtime tells
        the coordinator."""
        diverged = first_non_finite(self.layout, trained)
        if diverged is not None:
            raise UpdateRefused(f"training left NaN or Inf in tensor {diverged!r}")
        with np.errstate(over="ignore"):  # noise past the dtype's range is refused below, not warned of
            private, clipped = privatize_update(trained, global_weights, self.dp)
        if clipped is not None:  # the coordinator cannot tell from a noisy or compressed update: it is told
            metrics = {**metrics, DP_CLIPPED: float(clipped)}
        if self.dp is not None and (unbounded := first_non_finite(self.layout, private)) is not None:
            raise UpdateRefused(f"the task's client DP noise (dp_local_noise {self.dp[1]:g} x dp_clip_norm "
                                f"{self.dp[0]:g}) made tensor {unbounded!r} Inf")
        try:
            prepared = self.prepare(private, global_weights)
        except ValueError as err:  # the task's compression settings cannot encode it: no update will come
            raise UpdateRefused(f"preparing the update: {err}") from None
        if self.send(prepared, result, metrics, ends_at):
            return True
        self.refused()
        return False

    def prepare(self, update: list[np.ndarray], global_weights: list[np.ndarray]) -> PreparedUpload:
        """The tensors to send: the (privatized) new weights themselves."""
        return PreparedUpload(self.layout, list(update))

    def refused(self) -> None:
        """The prepared update was sent but not taken: nothing to undo for plain weights."""

    def close(self) -> None:
        """Nothing more: the coordinator folds the update by itself."""


class CompressedUpload(PlainUpload):
    """Compressed rounds: the delta from the global model, encoded as the task asks, with error feedback."""

    def __init__(self, settings: TaskSettings, layout: ModelLayout, send: Send, compressor: UpdateCompressor):
        super().__init__(settings, layout, send)
        self.compressor = compressor

    def prepare(self, update: list[np.ndarray], global_weights: list[np.ndarray]) -> PreparedUpload:
        """The encoded delta (ValueError if it cannot be encoded)."""
        dp = self.dp
        # Without local noise the coordinator verifies the clip norm: compression must stay within it.
        return self.compressor.prepare(self.settings, update, global_weights,
                                       max_norm=dp[0] if dp is not None and dp[1] == 0 else None)

    def refused(self) -> None:
        """The update was not taken: it does not count toward the error-feedback residual."""
        self.compressor.refused()
