"""A host's long-lived bidirectional stream to its coordinator, used as a call at a time: one message sent, its one
reply awaited (a message on an open stream costs both ends about half a unary call: benchmarks/grpc_call_cost.py).
A simulation host keeps two: its task long-polls (HostTaskStream, client/links.py) and its upload batches
(HostUploadStream, client/host_uploads.py)."""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Iterator

import grpc

WATCH_SECONDS = 0.25  # how often a stream looks whether the reply it awaits is late


class CallRefused(grpc.RpcError):
    """A refusal said in a reply or by the stream itself, read as any call's (``code()`` and ``details()``)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        """The status of the refusal."""
        return self._code

    def details(self) -> str:
        """The coordinator's reason."""
        return self._details


class StreamEnded(CallRefused):
    """The coordinator ended the stream without an answer to the message sent (a service's coordinator does when the
    next one takes the calls): the message was not taken, and a new stream reaches the coordinator that answers now."""


class HostStream:
    """One stream opened by ``open(requests)`` (a stream-stream method of the stub), named ``what`` in its errors: a
    message at a time, its reply awaited; a watch thread cancels the stream when a reply is late (checked every
    WATCH_SECONDS, so no timer per message: the caller opens a new stream after a failure)."""

    def __init__(self, open: Callable[[Iterator], Iterator], what: str):
        self.what = what
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._replies = open(iter(self._requests.get, None))
        self._due: float | None = None  # time.monotonic() the awaited reply is due by; None: none awaited
        self._late = False
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name=f"fedpar-{what.replace(' ', '-')}-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self._closed.wait(WATCH_SECONDS):
            due = self._due
            if due is not None and time.monotonic() > due:
                self._late = True
                self._replies.cancel()

    def send(self, request, timeout: float):
        """``request``'s reply; a DEADLINE_EXCEEDED refusal if it takes more than ``timeout`` seconds (give or take
        WATCH_SECONDS), an UNAVAILABLE one if the coordinator ended the stream."""
        self._due = time.monotonic() + timeout
        self._requests.put(request)
        try:
            return next(self._replies)
        except grpc.RpcError as err:
            if self._late:
                raise CallRefused(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"no reply within {timeout:.1f} s on the {self.what}") from None
            raise
        except StopIteration:
            raise StreamEnded(grpc.StatusCode.UNAVAILABLE, f"the coordinator ended the {self.what}") from None
        finally:
            self._due = None

    def close(self) -> None:
        """End the stream and its watch."""
        self._closed.set()
        self._requests.put(None)
        self._replies.cancel()


class KeptStream:
    """A HostStream opened at the first message and again after any failure (the failure is raised: the caller's
    retries decide what comes next)."""

    def __init__(self, open: Callable[[Iterator], Iterator], what: str):
        self._open, self.what = open, what
        self._stream: HostStream | None = None
        self._lock = threading.Lock()  # close() may come from another thread than send()

    def send(self, request, timeout: float, again: bool = True):
        """``request``'s reply on the kept stream (see HostStream.send); sent ``again`` on a new stream, once, when
        the coordinator ended the stream without taking it."""
        with self._lock:
            if self._stream is None:
                self._stream = HostStream(self._open, self.what)
            stream = self._stream
        try:
            return stream.send(request, timeout)
        except StreamEnded:
            self._drop(stream)
            if again:
                return self.send(request, timeout, again=False)
            raise
        except grpc.RpcError:
            self._drop(stream)
            raise

    def close(self) -> None:
        """End the stream, if open."""
        with self._lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def _drop(self, stream: HostStream) -> None:
        with self._lock:
            if self._stream is stream:
                self._stream = None
        stream.close()
