"""Staging slots on their own: granted in arrival order, taken back from a holder that fell behind while others
wait, and an agent whose upload lost its slot waits behind everyone else for its next one in that round, taking
no slot from anyone meanwhile."""

from __future__ import annotations

import asyncio
import time

import pytest

from fedpar.server.rounds import Refusal
from fedpar.server.uploads import QUIET_SECONDS, StagingSlots, UploadPace

MIN_RATE = 1000.0  # bytes per second


def _pace(total: int = 10_000) -> UploadPace:
    return UploadPace(10.0, MIN_RATE, time.monotonic() + 60, total)


def _acquire(slots: StagingSlots, agent: str, pace: UploadPace | None = None, interrupt=lambda: None,
             round_id: int = 1):
    return slots.acquire((agent, round_id), pace or _pace(), interrupt)


def test_a_holder_keeping_pace_keeps_its_slot_and_one_whose_bytes_came_slowly_loses_it_to_a_waiter():
    async def scenario():
        slots = StagingSlots(2)
        interrupted = []
        fast, slow = _pace(), _pace()
        fast_hold = await _acquire(slots, "fast", fast, lambda: interrupted.append("fast"))
        slow_hold = await _acquire(slots, "slow", slow, lambda: interrupted.append("slow"))
        for _ in range(4):  # fast keeps sending at 10x the minimum rate
            await asyncio.sleep(0.05)
            fast.note(500)
        slow.note(4)  # 4 bytes in 0.2 s: 20 bytes/s
        waiter = await asyncio.wait_for(_acquire(slots, "honest"), 0.5)
        assert interrupted == ["slow"] and slow.preempted and not fast.preempted and slots.overtakes == 1
        assert slow_hold.released and not fast_hold.released
        with pytest.raises(Refusal, match="fell behind --upload-min-bytes-per-second"):
            slow.note(4)  # its reader learns of it at the next bytes, if the interrupt did not stop it first
        slots.release(slow_hold)  # the overtaken upload's own release later gives nothing twice
        assert slots.free == 0
        slots.release(waiter)
        slots.release(fast_hold)
        assert slots.free == 2 and not slots.holders
    asyncio.run(scenario())


def test_a_complete_upload_being_folded_is_never_overtaken():
    async def scenario():
        slots = StagingSlots(1)
        done = _pace(total=4)
        hold = await _acquire(slots, "small", done)
        done.note(4)
        done.started -= 5 * QUIET_SECONDS  # long in its fold
        with pytest.raises(TimeoutError):
            await slots.acquire(("other", 1), _pace(), lambda: None, seconds=0.2)
        slots.release(hold)
        assert slots.free == 1 and not slots.waiting
    asyncio.run(scenario())


def test_a_silent_holder_is_overtaken_once_it_was_quiet_too_long():
    async def scenario():
        slots = StagingSlots(1)
        silent = _pace()
        await _acquire(slots, "silent", silent)
        started = time.monotonic()
        await asyncio.wait_for(_acquire(slots, "honest"), 3.0)
        assert QUIET_SECONDS - 0.05 <= time.monotonic() - started < QUIET_SECONDS + 0.5
        with pytest.raises(Refusal, match="fell behind"):
            silent.note(1)
    asyncio.run(scenario())


def test_an_overtaken_agent_waits_behind_the_others_takes_no_slot_and_must_send_at_once():
    async def scenario():
        slots = StagingSlots(1)
        slow = _pace()
        await _acquire(slots, "slow", slow)
        await asyncio.sleep(0.05)
        slow.note(1)
        honest_a = await asyncio.wait_for(_acquire(slots, "a"), 0.5)
        # slow asks again, then b: b is served first, though it came later
        retry = asyncio.ensure_future(_acquire(slots, "slow"))
        await asyncio.sleep(0.01)
        b = asyncio.ensure_future(_acquire(slots, "b"))
        await asyncio.sleep(0.01)
        slots.release(honest_a)
        b_hold = await asyncio.wait_for(b, 0.5)
        assert not retry.done()
        b_hold.pace.started -= 5 * QUIET_SECONDS  # b falls silent: the waiting slow agent still takes nothing
        await asyncio.sleep(0.2)
        assert not retry.done() and not b_hold.released
        slots.release(b_hold)
        retry_hold = await asyncio.wait_for(retry, 0.5)
        # holding a slot again and sending nothing at once, it is overtaken by the next waiter
        c = await asyncio.wait_for(_acquire(slots, "c"), 0.5)
        assert retry_hold.released and slots.overtakes == 2
        slots.release(c)
        again = await _acquire(slots, "slow", round_id=2)  # the next round forgets it
        assert ("slow", 1) not in slots.overtaken
        slots.release(again)
    asyncio.run(scenario())
