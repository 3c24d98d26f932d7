"""A client runtime hosting a population (client/links.HostLink) sends its members' small updates together: one
UploadHostUpdates call carries whatever updates are waiting when the call can go, each with its member's session
and checked by the coordinator as UploadSmall would be. While one call is in flight the next updates queue up, so
batches grow with the load by themselves.

A seat either waits for its update's own result (:meth:`HostUploads.send`: top-k error feedback must know whether
its update counted) or hands the update over and goes on with its next client (:meth:`HostUploads.send_later`):
then the update travels in the background, a busy coordinator's refusal is retried while its deadline allows, and
any other refusal is logged. Uploads are never left out of the coordinator's checks either way.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import grpc

from fedpar.client.transfer import UPLOAD_RETRYABLE
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.messages import CoordinatorStub

log = logging.getLogger("fedpar.simulate")
RETRY_PAUSE = 0.1  # seconds before a background update the coordinator was too busy for goes again
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class HostUploadRefused(grpc.RpcError):
    """One update of a batch refused, as UploadSmall would have ended (the agent reads ``code()`` and
    ``details()`` as from any call)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        """The status the coordinator refused the update with."""
        return self._code

    def details(self) -> str:
        """The coordinator's reason."""
        return self._details


@dataclass
class _Queued:
    """One update waiting for a batch: its message, when it stops being worth sending, who hears the result."""

    message: pb.SmallUpload
    deadline: float  # time.monotonic()
    done: Future
    background: bool


class HostUploads:
    """Batches a host's small updates into UploadHostUpdates calls of at most ``max_bytes`` each (one thread); a
    batch waits up to ``linger`` seconds for more updates after its first, while ``more_coming()`` says the seats
    are still making some (the last updates of a round go at once)."""

    def __init__(self, stub: CoordinatorStub, host: pb.AgentAuth, max_bytes: int, linger: float = 0.0,
                 max_updates: int = 512, more_coming: Callable[[], bool] = lambda: True):
        self.stub, self.host, self.max_bytes = stub, host, max_bytes
        self.max_updates, self.linger, self.more_coming = max_updates, linger, more_coming
        self._queue: queue.Queue = queue.Queue()
        self.refused_in_background = 0  # updates sent with send_later that did not count
        self._thread = threading.Thread(target=self._run, name="fedpar-host-uploads", daemon=True)
        self._thread.start()

    def send(self, stub: CoordinatorStub, message: pb.SmallUpload, timeout: float) -> pb.UploadReply:
        """Send ``message`` in the next batch and wait for its own result (the runtime's small-upload call; ``stub``
        is the task's, unused: the host's channel carries the batch)."""
        item = _Queued(message, time.monotonic() + timeout, Future(), background=False)
        self._queue.put(item)
        return item.done.result()

    def send_later(self, stub: CoordinatorStub, message: pb.SmallUpload, timeout: float) -> pb.UploadReply:
        """Queue ``message`` for the next batch and return at once, so the seat goes on with its next client."""
        self._queue.put(_Queued(message, time.monotonic() + timeout, Future(), background=True))
        return pb.UploadReply(accepted=True, message="queued")

    def close(self) -> None:
        """Stop after the batches already queued."""
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while (first := self._queue.get()) is not None:
            batch, size, stop = [first], first.message.ByteSize(), False
            until = time.monotonic() + self.linger
            while len(batch) < self.max_updates:
                try:  # a seat queues its update before it stops counting as more to come
                    wait = self.more_coming()
                    item = self._queue.get(timeout=max(0.0, until - time.monotonic())) if wait \
                        else self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                if size + item.message.ByteSize() > self.max_bytes:
                    self._queue.put(item)  # the next batch starts with it (order among seats does not matter)
                    break
                batch.append(item)
                size += item.message.ByteSize()
            self._send(batch)
            if stop:
                break

    def _send(self, batch: list[_Queued]) -> None:
        """One call for ``batch``; each update's result goes to its seat, or is retried or logged."""
        try:
            reply = self.stub.UploadHostUpdates(
                pb.HostUploads(host=self.host, uploads=[q.message for q in batch]),
                timeout=max(0.5, min(q.deadline for q in batch) - time.monotonic()))
            results = list(reply.results)
        except grpc.RpcError as err:
            for q in batch:
                self._settle(q, err)
            return
        results += [pb.HostUploadResult(code=grpc.StatusCode.INTERNAL.value[0],
                                        message="the coordinator sent no result for it")] * (len(batch) - len(results))
        for q, result in zip(batch, results):
            if result.code:
                self._settle(q, HostUploadRefused(_CODES.get(result.code, grpc.StatusCode.UNKNOWN), result.message))
            else:
                q.done.set_result(pb.UploadReply(accepted=result.accepted, message=result.message))

    def _settle(self, q: _Queued, err: grpc.RpcError) -> None:
        """A refused update: its seat hears it; a background one is tried again while the coordinator is busy and
        its deadline allows, else logged."""
        if not q.background:
            q.done.set_exception(err)
        elif err.code() in UPLOAD_RETRYABLE and time.monotonic() + RETRY_PAUSE < q.deadline:
            threading.Timer(RETRY_PAUSE, self._queue.put, (q,)).start()
        else:
            self.refused_in_background += 1
            log.info("an update sent in the background was refused: %s: %s", err.code().name, err.details())
