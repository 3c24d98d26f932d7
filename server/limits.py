"""Admission limits that keep one agent (or a flood of them) from exhausting the coordinator.

Every refusal is a :class:`Refusal` with RESOURCE_EXHAUSTED and a message saying which limit and
which option raises it. All state is per agent id and bounded by the agents active now, not by all that ever
called: per-call counts end with their calls, upload attempts with their round, byte buckets once refilled. The
coordinator's event loop is the only user, so nothing here locks.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager, contextmanager
from typing import AsyncIterator, Iterator

import grpc

from fedpar.server.config import CoordinatorConfig
from fedpar.server.rounds import Refusal

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


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
        self._queued_uploads = 0
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

    @contextmanager
    def upload_queue(self) -> Iterator[None]:
        """Hold a place among the uploads that are staged or waiting to be; refuse when they are full.

        Every waiting upload has up to one HTTP/2 window of data buffered in the transport, so bounding
        the queue keeps that memory independent of how many agents upload at once.
        """
        if self._queued_uploads >= self.config.max_queued_uploads:
            raise Refusal(EXHAUSTED, f"the coordinator is busy with {self._queued_uploads} uploads "
                                     f"(--max-queued-uploads {self.config.max_queued_uploads}); retry in a moment")
        self._queued_uploads += 1
        try:
            yield
        finally:
            self._queued_uploads -= 1

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

    def count_chunk(self, chunks_so_far: int) -> None:
        """Refuse one more upload chunk beyond the chunk-count limit."""
        if chunks_so_far >= self.config.max_upload_chunks:
            raise Refusal(EXHAUSTED, f"upload has more than {self.config.max_upload_chunks} chunks "
                                     "(--max-upload-chunks); send larger chunks. The update was not applied")

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

    def forget(self, agent_id: str) -> None:
        """Drop what is kept about an agent that left."""
        self._attempts.pop(agent_id, None)
        self._bytes.pop(agent_id, None)
