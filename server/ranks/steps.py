"""The one thread that makes a rank's collectives (server/ranks/leader.py and ingest.py), and how a step stuck on a
lost rank is given up: a gloo collective waiting for a hung peer cannot be woken before its timeout (aborting the
group does not wake it either), so the step's thread is left to that timeout and a fresh thread takes the group's
next steps (forming it again); the group refuses any further collective from the thread left behind."""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future
from typing import Awaitable, Callable

from fedpar.server.ranks.group import RankGroup, RankMissing

POLL_SECONDS = 0.25  # how often a step in progress asks whether to give it up


class CollectiveThread:
    """Runs a rank's steps of collectives in order, on one thread, each given up when ``lost`` says so."""

    def __init__(self, group: RankGroup):
        self.group = group
        self._steps = self._fresh()

    def _fresh(self) -> queue.SimpleQueue:
        """A new thread for the steps to come, the only one the group takes collectives from. A daemon: one left in a
        collective until its timeout does not hold the process's exit."""
        steps: queue.SimpleQueue = queue.SimpleQueue()
        thread = threading.Thread(target=_serve, args=(steps,), name="fedpar-ranks", daemon=True)
        thread.start()
        self.group.claim(thread.ident)
        return steps

    async def run(self, fn, *args, lost: Callable[[], Awaitable[str | None]] | None = None):
        """``fn(*args)`` on the thread; while it runs, ``lost()`` every POLL_SECONDS: once it names why the step
        cannot complete (a rank is lost), the step is given up (RankMissing with that reason) and a fresh thread
        makes the next ones."""
        done = Future()
        self._steps.put((done, fn, args))
        future = asyncio.wrap_future(done)
        while lost is not None:
            finished, _ = await asyncio.wait([future], timeout=POLL_SECONDS)
            if finished:
                break
            reason = await lost()
            if reason and not future.done():
                future.add_done_callback(_ignore)  # it fails at its timeout, or at once if the rank is killed
                self._steps.put(None)
                self._steps = self._fresh()
                raise RankMissing(reason)
        return await future

    def close(self) -> None:
        """No more steps: the thread ends after the one it runs."""
        self._steps.put(None)


def _serve(steps: queue.SimpleQueue) -> None:
    while (step := steps.get()) is not None:
        done, fn, args = step
        if not done.set_running_or_notify_cancel():
            continue
        try:
            done.set_result(fn(*args))
        except BaseException as exc:  # handed to the step's caller, whatever it is
            done.set_exception(exc)


def _ignore(future: asyncio.Future) -> None:
    """Retrieve a given-up step's outcome (else asyncio logs it as never retrieved)."""
    if not future.cancelled():
        future.exception()
