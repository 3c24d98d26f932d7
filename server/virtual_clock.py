"""The virtual clock of simulated federations (``--clock virtual``): the deadline and first-K-of-M act on
simulated time, so a straggler study runs as fast as the machine allows.

A round under the virtual clock has two steps. First every sampled member's host reports how many simulated
seconds the member needs for its task (download, its local steps at its device's speed, upload: from its trace
and its real amount of work), or that it would not finish (it drops out, or goes offline first). Then the clock
lets train only those the real-time rules would have counted: the first K that finish within the deadline
(server/deadline.py :func:`first_k_in_time`). Nobody else trains, so no real time is spent on stragglers. The
round lasts, in simulated time, until the K-th finish (target reached), the deadline (too few in time), or the last
finish (every sampled member answered in time, fewer than K of them). The chosen members then train and upload
through the same validation and fold as ever; the wall clock only guards against hosts that stop answering.
It is one of the coordinator's clocks (server/coordinator.py RoundClock).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import grpc

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.server.deadline import DEADLINE, WALL_GUARD, Decision, first_k_in_time, set_within, virtual_close_reason
from fedpar.server.members import TooFewMembers
from fedpar.server.rounds import Refusal, RoundState

log = logging.getLogger("fedpar.server")
IDLE_LIMIT_SECONDS = 86_400.0  # a trace's day: availability repeats daily, so no later time brings more online
IDLE_STEP_SECONDS = 60.0  # the least the clock moves while too few are online (a day in at most 1,440 steps)


class VirtualClock:
    """The coordinator's simulated time, and the finish times reported in the current round."""

    wall_reason = WALL_GUARD  # real time only guards the round: its deadline is simulated

    def __init__(self, deadline_seconds: float, wall_seconds: float, seconds: float = 0.0):
        self.deadline_seconds = deadline_seconds  # the straggler deadline, in simulated seconds
        self.wall_seconds = wall_seconds  # real seconds a round may last (its estimates may take half)
        self.seconds = seconds  # simulated time at the start of the current (or next) round
        self.idle_steps = 0  # times the clock moved on while too few were online (a host's long-poll then answers)
        self._finishes: dict[str, float] = {}
        self._all_in: asyncio.Event | None = None
        self._round_id = 0
        self.decision: Decision | None = None  # the current round's, once decided

    def open_round(self, state: RoundState) -> None:
        """Hold every sampled member's task until the decision."""
        for slot in state.slots.values():
            slot.go = False
        self._finishes = {}
        self._round_id = state.round_id
        self._all_in = asyncio.Event()
        self.decision = None

    def record(self, state: RoundState | None, agent_id: str, task_id: str, seconds: float) -> None:
        """One member's reported finish time; a Refusal if it is not one of this round's held tasks or is not a
        number."""
        if state is None or state.round_id != self._round_id or state.closed:
            return  # an estimate for a round that is over: nothing to decide any more
        slot = state.slot_for(agent_id, task_id, held_ok=True)
        if not math.isfinite(seconds):
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"finish estimate of {agent_id!r} must be a finite number of seconds (negative: will not "
                          "finish)")
        if slot.go or agent_id in self._finishes:
            return  # already decided or already reported: the first report stands
        self._finishes[agent_id] = seconds
        if len(self._finishes) == len(state.slots):
            self._all_in.set()

    async def choose(self, state: RoundState, members) -> None:
        """Wait for the sampled members' finish times (half the wall guard at most: the rest then never finish),
        then let the first K within the deadline go (``members.let_go``) and count only them as still to answer."""
        await set_within(self._all_in, self.wall_seconds / 2)
        decision = first_k_in_time(self._finishes, state.slots, state.target, self.deadline_seconds)
        for slot in decision.chosen:
            slot.go = True
        state.target = len(decision.chosen)
        state.answering = len(decision.chosen)
        self._round_id = 0
        self.decision = decision
        log.info("round %d: %d of %d sampled clients train (virtual clock: %s after %.1f simulated seconds)",
                 state.round_id, len(decision.chosen), state.sampled, decision.reason, decision.seconds)
        if not decision.chosen:
            state.close(DEADLINE)
        members.let_go([slot.agent_id for slot in decision.chosen])

    def stamp(self, task: pb.TrainTask) -> None:
        """Mark the task as simulated: the clock's time now and the simulated deadline."""
        task.virtual_clock, task.clock_seconds = True, self.seconds
        task.clock_deadline_seconds = self.deadline_seconds

    def stamp_reply(self, reply: pb.PullHostTasksReply) -> None:
        """The clock's time, for a simulation host."""
        reply.clock_seconds, reply.virtual_clock = self.seconds, True

    async def wait_for_live(self, members, count: int, wait_seconds: float | None) -> None:
        """Until ``count`` members are online. While that many have joined but fewer are online (a night of their
        availability traces), simulated time moves on a deadline (at least IDLE_STEP_SECONDS) at a time, as if a
        round that could not start had lasted one, once every host has told who is online at the time before.
        TooFewMembers when a whole simulated day passes so, or after ``wait_seconds`` real seconds (None: no limit)
        with too few joined."""
        started, idle_from, most = time.monotonic(), self.seconds, 0
        while (live := members.note_live()) < count:
            most = max(most, live)
            if len(members.registry) >= count and members.hosts_heard(self.seconds):
                if self.seconds - idle_from >= IDLE_LIMIT_SECONDS:
                    raise TooFewMembers(
                        f"at most {most} of the {len(members.registry)} clients were online at once over a simulated "
                        f"day of their availability traces (virtual clock, from {idle_from:,.0f} s); a round needs "
                        f"{count} (simulate: --clients-per-round; serve: --min-available): sample fewer clients a "
                        "round, or give a trace with more online")
                self.seconds += max(self.deadline_seconds, IDLE_STEP_SECONDS)
                self.idle_steps += 1
                members.wake_all()  # the hosts' long-polls answer with the new time
            elif wait_seconds is not None and time.monotonic() - started > wait_seconds:
                raise TooFewMembers(f"only {live} live agents after {wait_seconds}s; need min_available={count}")
            await members.changed(0.5)
        if self.seconds > idle_from:
            log.info("virtual clock: %d clients online at %.0f simulated seconds, after %.0f with too few",
                     members.live_count(), self.seconds, self.seconds - idle_from)

    def finish_round(self, state: RoundState) -> dict:
        """Advance the clock by the round just finished; its metrics columns (simulated seconds of the round and
        since the start, why it closed in simulated time, and so why it closed: :func:`virtual_close_reason`)."""
        decision = self.decision or Decision([], 0.0, "not decided")
        self.seconds += decision.seconds
        self.decision = None
        return {"sim_round_seconds": decision.seconds, "sim_seconds": self.seconds, "sim_close_reason": decision.reason,
                "close_reason": virtual_close_reason(state.close_reason, decision.reason)}

    def state(self) -> dict:
        """The simulated time, for the checkpoint (a restart goes on from there)."""
        return {"clock_seconds": self.seconds}

    def restore(self, state: dict) -> None:
        """Go on from a checkpoint's simulated time."""
        self.seconds = float(state.get("clock_seconds", 0.0))
