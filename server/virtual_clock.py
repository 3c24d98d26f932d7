"""The virtual clock of simulated federations (``--clock virtual``): the deadline and first-K-of-M act on
simulated time, so a straggler study runs as fast as the machine allows.

A round under the virtual clock has two steps. First every sampled member's host reports how many simulated
seconds the member needs for its task (download, its local steps at its device's speed, upload: from its trace
and its real amount of work), or that it would not finish (it drops out, or goes offline first). Then the
coordinator orders the members by finish time and lets train only those the real-time rules would have counted:
the first K that finish within the deadline. Nobody else trains, so no real time is spent on stragglers. The
round lasts, in simulated time, until the K-th finish (target reached), the deadline (too few in time), or the last
finish (every sampled member answered in time, fewer than K of them). The chosen members then train and upload
through the same validation and fold as ever; the wall clock only guards against hosts that stop answering.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import grpc

from fedpar.server.rounds import AgentSlot, Refusal, RoundState


@dataclass
class Decision:
    """What the virtual clock made of one round: whom it lets train, how long the round lasted, and why."""

    chosen: list[AgentSlot]
    seconds: float  # simulated duration of the round
    reason: str  # as RoundState.close_reason: target reached | deadline | every sampled agent answered


def decide(finishes: dict[str, float], slots: dict[str, AgentSlot], target: int, deadline: float) -> Decision:
    """The first ``target`` members to finish within ``deadline`` simulated seconds (``finishes``: each member's
    reported seconds; a missing or negative one never finishes), ties broken by agent id."""
    in_time = sorted((s, a) for a, s in finishes.items() if 0 <= s <= deadline and a in slots)
    chosen = [slots[a] for _, a in in_time[:target]]
    if len(in_time) >= target:
        return Decision(chosen, in_time[target - 1][0] if target else 0.0, "target reached")
    if len(in_time) == len(slots):
        return Decision(chosen, in_time[-1][0] if in_time else 0.0, "every sampled agent answered")
    return Decision(chosen, deadline, "deadline")


class VirtualClock:
    """The coordinator's simulated time, and the finish times reported in the current round."""

    def __init__(self, seconds: float = 0.0):
        self.seconds = seconds  # simulated time at the start of the current (or next) round
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

    async def wait_for_estimates(self, timeout: float) -> None:
        """Until every sampled member's finish time is in, or ``timeout`` seconds (the rest then never finish)."""
        try:
            await asyncio.wait_for(self._all_in.wait(), timeout=timeout)
        except asyncio.TimeoutError:
            pass

    def close_estimates(self, state: RoundState, deadline: float) -> Decision:
        """Decide the round: let the chosen members go, and count only them as still to answer."""
        decision = decide(self._finishes, state.slots, state.target, deadline)
        for slot in decision.chosen:
            slot.go = True
        state.target = len(decision.chosen)
        state.answering = len(decision.chosen)
        self._round_id = 0
        self.decision = decision
        return decision

    def finish_round(self) -> dict:
        """Advance the clock by the round just finished; its metrics columns (simulated seconds of the round and
        since the start, and why it closed in simulated time)."""
        decision = self.decision or Decision([], 0.0, "not decided")
        self.seconds += decision.seconds
        self.decision = None
        return {"sim_round_seconds": decision.seconds, "sim_seconds": self.seconds, "sim_close_reason": decision.reason}
