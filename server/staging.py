"""Staging slots, earned by progress: each staged upload holds one model copy, so their number is bounded
(--max-concurrent-uploads), and an upload keeps its slot only while it keeps pace.

An upload that falls silent for --upload-idle-seconds, or whose average rate falls below
--upload-min-bytes-per-second once RATE_GRACE_SECONDS have passed, is refused (:class:`UploadPace`). While other
uploads wait for a slot, the bar is higher (:meth:`UploadPace.behind`): a holder whose bytes so far came slower
than the minimum rate, or that is behind it and silent for QUIET_SECONDS, gives its slot to the first waiter at
once. An agent whose upload lost its slot that way waits behind everyone else for its next one in the round, and
while waiting takes no slot from anyone (:class:`StagingSlots`), so slow honest agents cannot take turns
overtaking each other: each is overtaken at most once a round by an upload that was not. Both transports use
them; all slot state changes on the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable

import grpc

from fedpar.server.rounds import Refusal

RATE_GRACE_SECONDS = 2.0  # with no one waiting, an upload's average rate counts from this long after its slot
QUIET_SECONDS = 1.0  # with uploads waiting, a holder behind the minimum rate may fall silent this long at most
WAITER_POLL_SECONDS = 0.05  # how often a waiting upload looks for a holder that fell behind


class UploadPace:
    """Whether a staged upload still earns its staging slot.

    It must not fall silent for ``idle_seconds``, and from RATE_GRACE_SECONDS on (or ``idle_seconds`` if shorter)
    its average rate must stay at least ``min_bytes_per_second``; either failure refuses it (not final: the agent
    may try again), so an upload trickling bytes holds a slot for seconds, not until the idle limit or the round's
    deadline. Each chunk may take ``idle_seconds`` plus its size at the minimum rate, so an honest upload on a link
    at least that fast is never refused. Both transports keep one per staged upload; :meth:`note` and the wait
    methods run on the upload's own thread or task, :meth:`behind` on the loop.
    """

    def __init__(self, idle_seconds: float, min_bytes_per_second: float, deadline_at: float, total_bytes: int):
        self.idle, self.min_rate, self.deadline_at = idle_seconds, min_bytes_per_second, deadline_at
        self.total = total_bytes
        self.grace = min(idle_seconds, RATE_GRACE_SECONDS)
        self.started = time.monotonic()
        self.last_at: float | None = None  # when its latest bytes came (None: none since the slot)
        self.received = 0
        self.preempted = False  # set (loop) when its slot went to a waiting upload

    def restart(self) -> None:
        """Start the clock: the upload holds a staging slot from now on."""
        self.started, self.last_at, self.received = time.monotonic(), None, 0

    def next_wait(self, nbytes: int = 0) -> float:
        """Seconds the next ``nbytes`` may take to arrive: the idle limit (plus their time at the minimum rate),
        or less when the round's deadline is nearer."""
        allowed = self.idle + (nbytes / self.min_rate if self.min_rate else 0.0)
        return max(0.0, min(allowed, self.deadline_at - time.monotonic()))

    def stalled(self) -> Refusal:
        """The refusal for an upload whose next bytes did not come in :meth:`next_wait` (or that lost its slot)."""
        if self.preempted:
            return self.overtaken()
        if time.monotonic() >= self.deadline_at - 0.01:
            return Refusal(grpc.StatusCode.DEADLINE_EXCEEDED,
                           "no upload data arrived before the round's deadline; the update was not applied")
        return Refusal(grpc.StatusCode.DEADLINE_EXCEEDED,
                       f"the upload stalled after {self.received} bytes (no progress for {self.idle:g} s, "
                       "--upload-idle-seconds); its staging slot went to others and the update was not applied: "
                       "send it again")

    def overtaken(self) -> Refusal:
        """The refusal for an upload whose slot went to a waiting one because it fell behind."""
        return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"the upload fell behind --upload-min-bytes-per-second {self.min_rate:.0f} ({self.received} "
                       f"bytes in {time.monotonic() - self.started:.1f} s) while other uploads waited; its staging "
                       "slot went to them and the update was not applied: send it again")

    def note(self, nbytes: int) -> None:
        """Count ``nbytes`` arrived; a Refusal if the upload lost its slot or became slower than the minimum rate."""
        now = time.monotonic()
        if self.preempted:
            raise self.overtaken()
        self.last_at = now
        self.received += nbytes
        elapsed = now - self.started
        if elapsed > self.grace and self.received < min(self.total, self.min_rate * elapsed):
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the upload is too slow ({self.received / elapsed:.0f} bytes/s over {elapsed:.0f} s, "
                          f"below --upload-min-bytes-per-second {self.min_rate:.0f}); its staging slot went to "
                          "others and the update was not applied: send it again")

    def behind(self, now: float, on_notice: bool = False) -> bool:
        """Whether, with uploads waiting for its slot, it should give the slot up (loop): its bytes so far came
        slower than the minimum rate, or it is behind that rate and silent for QUIET_SECONDS (an agent's round
        trip plus a chunk). ``on_notice``: it lost a slot this round already, so any silence is too long."""
        if self.received >= self.total:
            return False  # all staged: it is being checked or folded
        if self.last_at is not None and self.received < self.min_rate * (self.last_at - self.started):
            return True
        quiet = now - (self.started if self.last_at is None else self.last_at)
        return (on_notice or quiet >= QUIET_SECONDS) and self.received < self.min_rate * (now - self.started)


class SlotHold:
    """One upload's claim on a staging slot: its pace, and how to stop it when the slot is taken back."""

    def __init__(self, key: tuple, pace: UploadPace, interrupt: Callable[[], None]):
        self.key, self.pace, self.interrupt = key, pace, interrupt
        self.released = False


class StagingSlots:
    """``count`` staging slots: granted in arrival order, except that agents whose upload was overtaken this round
    wait behind the rest; while uploads wait, a holder that fell behind (:meth:`UploadPace.behind`) is overtaken."""

    def __init__(self, count: int):
        self.free = count
        self.holders: list[SlotHold] = []
        self.waiting: deque[tuple[bool, asyncio.Future]] = deque()  # (overtaken before, granted when done)
        self.overtaken: set[tuple] = set()  # (agent, round) keys whose upload lost its slot
        self.overtakes = 0

    async def acquire(self, key: tuple, pace: UploadPace, interrupt: Callable[[], None],
                      seconds: float | None = None) -> SlotHold:
        """Wait for a slot for the upload ``key`` = (agent id, round id) (loop); TimeoutError after ``seconds``.
        ``interrupt()`` is called (loop) if the slot is taken back, to stop the upload's wait for its bytes."""
        self.overtaken = {k for k in self.overtaken if k[1] == key[1]}  # only this round's count
        if self.free and not self.waiting:
            self.free -= 1
        else:
            await self._wait(key in self.overtaken, seconds)
        hold = SlotHold(key, pace, interrupt)
        self.holders.append(hold)
        return hold

    async def _wait(self, on_notice: bool, seconds: float | None) -> None:
        loop = asyncio.get_running_loop()
        until = None if seconds is None else loop.time() + seconds
        granted = loop.create_future()
        entry = (on_notice, granted)
        self.waiting.append(entry)
        try:
            while not granted.done():
                if not on_notice:  # one overtaken this round takes no slot from anyone
                    self._overtake_one()
                wait = WAITER_POLL_SECONDS if until is None else min(WAITER_POLL_SECONDS, until - loop.time())
                if wait <= 0:
                    raise TimeoutError("no staging slot became free in time")
                await asyncio.wait((granted,), timeout=wait)
        except BaseException:
            if granted.done() and not granted.cancelled():
                self._pass_on()  # granted as it gave up: the slot goes to the next
            else:
                granted.cancel()
                self.waiting.remove(entry)
            raise

    def _overtake_one(self) -> None:
        """Take a slot back from one holder that fell behind, if one did, for the first waiter."""
        now = time.monotonic()
        for hold in self.holders:
            if hold.pace.behind(now, on_notice=hold.key in self.overtaken):
                hold.pace.preempted = True
                self.overtaken.add(hold.key)
                self.overtakes += 1
                self.release(hold)
                hold.interrupt()
                return

    def release(self, hold: SlotHold) -> None:
        """Give the slot back (loop); a slot already taken back is not given twice."""
        if hold.released:
            return
        hold.released = True
        self.holders.remove(hold)
        self._pass_on()

    def _pass_on(self) -> None:
        """A slot fell free: to the first waiter that was not overtaken this round, else the first, else free."""
        if not self.waiting:
            self.free += 1
            return
        entry = next((e for e in self.waiting if not e[0]), self.waiting[0])
        self.waiting.remove(entry)
        entry[1].set_result(None)
