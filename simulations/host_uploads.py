"""A simulation host's seats send their small updates together: one UploadHostUpdates call carries whatever updates
are waiting when the call can go, each with its member's session and checked by the coordinator as UploadSmall
would be. While one call is in flight the next updates queue up, so batches grow with the load by themselves and
an update never waits for a batch to fill."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

import grpc

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.stubs import CoordinatorStub


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


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class HostUploads:
    """Batches a host's small updates into UploadHostUpdates calls of at most ``max_bytes`` each (one thread).

    ``seats`` updates at most can wait at once (each seat waits for its result), so a batch that holds that many
    goes at once; a smaller one waits up to ``linger`` seconds for the seats still training.
    """

    def __init__(self, stub: CoordinatorStub, host: pb.AgentAuth, max_bytes: int, seats: int = 512,
                 linger: float = 0.0):
        self.stub, self.host, self.max_bytes = stub, host, max_bytes
        self.max_updates, self.linger = min(seats, 512), linger
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="fedpar-host-uploads", daemon=True)
        self._thread.start()

    def send(self, stub: CoordinatorStub, message: pb.SmallUpload, timeout: float) -> pb.UploadReply:
        """Send ``message`` in the next batch and wait for its own result (the Agent's small-upload hook; ``stub``
        is the agent's, unused: the host's channel carries the batch)."""
        done: Future = Future()
        self._queue.put((message, timeout, done))
        return done.result()

    def close(self) -> None:
        """Stop after the batches already queued."""
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while (first := self._queue.get()) is not None:
            batch, size, stop = [first], first[0].ByteSize(), False
            until = time.monotonic() + self.linger
            while len(batch) < self.max_updates:
                try:
                    item = self._queue.get(timeout=max(0.0, until - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                if size + item[0].ByteSize() > self.max_bytes:
                    self._queue.put(item)  # the next batch starts with it (order among seats does not matter)
                    break
                batch.append(item)
                size += item[0].ByteSize()
            self._send(batch)
            if stop:
                break

    def _send(self, batch: list) -> None:
        """One call for ``batch``; each waiting seat gets its own result (or the call's failure)."""
        try:
            reply = self.stub.UploadHostUpdates(pb.HostUploads(host=self.host, uploads=[m for m, _, _ in batch]),
                                                timeout=min(t for _, t, _ in batch))
        except grpc.RpcError as err:
            for _, _, done in batch:
                done.set_exception(err)
            return
        for (_, _, done), result in zip(batch, reply.results):
            if result.code:
                done.set_exception(HostUploadRefused(_CODES.get(result.code, grpc.StatusCode.UNKNOWN),
                                                     result.message))
            else:
                done.set_result(pb.UploadReply(accepted=result.accepted, message=result.message))
        for _, _, done in batch[len(reply.results):]:
            done.set_exception(HostUploadRefused(grpc.StatusCode.INTERNAL, "the coordinator sent no result for it"))
