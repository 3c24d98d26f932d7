"""Calls to a coordinator that outlive it: back off while it is unreachable, and join again when it no longer knows
the session (it restarted, or forgot a silent participant).

One rule for every client of the coordinator: the client runtime (client/runtime.py) makes its calls through
:class:`Reconnecting`, whether it joins with Join (a deployed agent) or JoinPopulation (a population's host).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

import grpc

from fedpar.client.backoff import RETRYABLE, Backoff, Uniform

log = logging.getLogger("fedpar.client")
T = TypeVar("T")


class FatalAgentError(RuntimeError):
    """The coordinator refused this agent (or host) in a way retrying cannot fix."""


class Reconnecting:
    """Runs calls to the coordinator at ``server`` for ``who``: a call refused UNAUTHENTICATED makes ``join`` run
    again (a new session) and is then retried; while the coordinator is unreachable (or busy) calls are retried
    with jittered exponential backoff from ``first`` to ``cap`` seconds, for ever or until ``give_up_after``
    seconds without reaching it. Any other refusal is a FatalAgentError.

    ``stopped()``: the caller wants to leave (no more waiting); ``diagnose()``, asked when the coordinator is
    unreachable: what may be the cause, said in each retry line (e.g. its TLS setting differs), or None; it raises
    FatalAgentError for a cause retrying cannot cure (the agent's TLS handshake check); ``on_rejoin()``: counted.
    """

    def __init__(self, who: str, server: str, join: Callable[[], None], first: float, cap: float, rng: Uniform,
                 give_up_after: float | None = None, stopped: Callable[[], bool] = lambda: False,
                 diagnose: Callable[[], str | None] = lambda: None, on_rejoin: Callable[[], None] = lambda: None):
        self.who, self.server, self._join = who, server, join
        self.first, self.cap, self.rng = first, cap, rng
        self.give_up_after = give_up_after
        self.stopped, self.diagnose, self.on_rejoin = stopped, diagnose, on_rejoin

    def join(self) -> None:
        """Join, retried while the coordinator is unreachable (a refused join is fatal)."""
        self._retry(self._join, rejoin=False)

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()``, joining again first whenever the coordinator no longer knows the session."""
        return self._retry(fn, rejoin=True)

    def _retry(self, fn: Callable[[], T], rejoin: bool) -> T:
        backoff = Backoff(self.first, self.cap, self.rng)
        unreachable_since = None
        while True:
            try:
                return fn()
            except grpc.RpcError as err:
                code = err.code()
                if code == grpc.StatusCode.UNAUTHENTICATED and rejoin:
                    log.info("%s: session not recognised (%s); joining again", self.who, err.details())
                    self.on_rejoin()
                    self.join()
                    continue
                if code not in RETRYABLE:
                    raise FatalAgentError(f"{self.who}: coordinator refused: {code.name}: {err.details()}") from None
                mismatch = self.diagnose() if code == grpc.StatusCode.UNAVAILABLE else None
                why = f": {mismatch}" if mismatch else ""
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if self.give_up_after is not None and now - unreachable_since > self.give_up_after:
                    raise FatalAgentError(f"{self.who}: coordinator at {self.server} unreachable for "
                                          f"{self.give_up_after}s" + (why or "; is it running, and does its TLS "
                                          "setting (--certs/--insecure) match this agent's?")) from None
                if self.stopped():
                    raise FatalAgentError("stopped while the coordinator was unreachable") from None
                sleep = backoff.wait()
                log.info("%s: coordinator unreachable (%s)%s; retrying in %.1fs", self.who, code.name, why, sleep)
                time.sleep(sleep)
