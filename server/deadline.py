"""When a round closes, and what deadline its tasks carry: the server's one deadline policy.

A round of M sampled agents (M = ceil(K * overselect)) closes at the first of:
- K accepted updates ("target reached": first K of M);
- every sampled agent that may still answer has an accepted or rejected update ("every sampled agent answered"); an
  agent whose liveness ran out (no heartbeat for --liveness-timeout seconds: it died) no longer may;
- the straggler deadline, ``--deadline`` seconds after the tasks went out ("deadline"); a task carries the real
  seconds left until then, and an upload not complete by then is refused.
A secure round closes at the first of K accepted masked inputs, every agent that shared keys having uploaded, or
the deadline; a secure round whose protocol fails closes at once (:func:`secure_closing_reason`).
Under the virtual clock (server/virtual_clock.py) first K and the deadline act on simulated time
(:func:`first_k_in_time`), and a round its chosen members all answered closes for the simulated reason
(:func:`virtual_close_reason`); real time then only guards the round (``--round-wall-timeout``: "round wall
timeout").
Everything else on the server asks this module; the agent's side is in fedpar/task.py (stop_training_at,
upload_ends_at, and the Deadline a task trains to).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from fedpar.server.config import CoordinatorConfig

TARGET_REACHED = "target reached"
ALL_ANSWERED = "every sampled agent answered"
DEADLINE = "deadline"
ALL_KEYED_UPLOADED = "every agent that shared keys uploaded"
SECURE_FAILED = "secure aggregation failed"
WALL_GUARD = "round wall timeout"  # under the virtual clock: --round-wall-timeout real seconds passed first
LOST_CHECK_SECONDS = 1.0  # how often an open round looks for sampled agents that went silent


class Timed(Protocol):
    """What the policy reads of a round: when its deadline passes (server/rounds.py RoundState)."""

    closes_at: float  # time.monotonic() when the round's deadline passes


def target_reports(config: CoordinatorConfig, live: int) -> int:
    """K for a round with ``live`` agents available."""
    if config.fraction is not None:
        return max(config.min_reports, round(config.fraction * live))
    return config.clients_per_round


def cohort_size(config: CoordinatorConfig, live: int) -> int:
    """M = ceil(K * overselect), capped at the number of live agents."""
    return min(live, math.ceil(target_reports(config, live) * config.overselect))


def round_target(config: CoordinatorConfig, live: int, sampled: int) -> tuple[int, str]:
    """The updates a round waits for when ``sampled`` of ``live`` agents were sampled, and what moved it from the K
    the settings say ('' when nothing did), for the round's log line."""
    k, why = target_reports(config, live), ""
    if config.fraction is not None and k > round(config.fraction * live):
        why = (f"--fraction {config.fraction} of {live} live agents is {round(config.fraction * live)}, below "
               f"--min-reports {config.min_reports}; using {k}")
    if sampled < k:
        asked = f"--clients-per-round {k}" if config.fraction is None else f"K {k}"
        why = f"{asked} is above the {sampled} agents sampled; using {sampled}"
    return min(k, sampled), why


def wall_seconds(config: CoordinatorConfig) -> float:
    """Real seconds a round may last: the straggler deadline, or under the virtual clock the wall guard."""
    return config.round_wall_seconds if config.virtual_clock else config.deadline_seconds


def secure_stage_seconds(config: CoordinatorConfig) -> float:
    """The longest wait of each of a secure round's key stages: --secagg-stage-seconds, at most a third of the
    round's real time (its two key stages and the masked uploads share it: an agent that died before sharing its keys
    must not hold the stages past the deadline, which would fail the round)."""
    return min(config.secagg_stage_seconds, wall_seconds(config) / 3)


def seconds_left(state: Timed) -> float:
    """Real seconds left before the round's deadline: what a task handed out now carries."""
    return max(0.0, state.closes_at - time.monotonic())


def closing_reason(accepted: int, rejected: int, target: int, answering: int) -> str:
    """Why a round with these counts closes now ('' while it stays open): K accepted, or all answered."""
    if accepted >= target:
        return TARGET_REACHED
    if accepted + rejected >= answering:
        return ALL_ANSWERED
    return ""


def secure_closing_reason(accepted: int, target: int, all_keyed_uploaded: bool) -> str:
    """Why a secure round with ``accepted`` masked inputs closes now ('' while it stays open): every agent that
    shared keys uploaded, or K accepted."""
    if all_keyed_uploaded:
        return ALL_KEYED_UPLOADED
    if accepted >= target:
        return TARGET_REACHED
    return ""


def virtual_close_reason(real: str, simulated: str) -> str:
    """Why a virtual-clock round closed: the simulated reason when its chosen members all answered (the real round
    only waited for them; its 'target' was the number chosen), else the real one (the wall guard, a failure)."""
    return simulated if real in (TARGET_REACHED, ALL_ANSWERED, ALL_KEYED_UPLOADED) else real


async def set_within(event: asyncio.Event, seconds: float) -> bool:
    """Wait until ``event`` is set or ``seconds`` pass; False if the time passed first. The caller's own task waits
    (no second task, as asyncio.wait_for would make), so a set event wakes it in one turn of the loop."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def until_closed(state: Timed, closed: asyncio.Event, look_for_lost: Callable[[], None] = lambda: None) -> bool:
    """Wait until ``closed`` is set or the round's deadline passes; False if the deadline passed first. Every
    LOST_CHECK_SECONDS ``look_for_lost()`` runs: a sampled agent whose liveness ran out before it answered never will,
    so it is counted as answered with nothing (which may close the round: every other one answered)."""
    while (left := seconds_left(state)) > 0:
        if await set_within(closed, min(left, LOST_CHECK_SECONDS)):
            return True
        look_for_lost()
    return closed.is_set()


@dataclass
class Decision:
    """Who trains in a round on simulated time, how long the round lasted there, and why it closed."""

    chosen: list  # the chosen members' slots (server/rounds.py AgentSlot), first to finish first
    seconds: float  # simulated duration of the round
    reason: str  # as RoundState.close_reason: target reached | deadline | every sampled agent answered


def first_k_in_time(finishes: dict[str, float], slots: dict, target: int, deadline: float) -> Decision:
    """The first ``target`` members to finish within ``deadline`` simulated seconds (``finishes``: each member's
    reported seconds; a missing or negative one never finishes), ties broken by agent id."""
    in_time = sorted((s, a) for a, s in finishes.items() if 0 <= s <= deadline and a in slots)
    chosen = [slots[a] for _, a in in_time[:target]]
    if len(in_time) >= target:
        return Decision(chosen, in_time[target - 1][0] if target else 0.0, TARGET_REACHED)
    if len(in_time) == len(slots):
        return Decision(chosen, in_time[-1][0] if in_time else 0.0, ALL_ANSWERED)
    return Decision(chosen, deadline, DEADLINE)
