"""The clock a coordinator's rounds run on: real time in production (:class:`WallClock`), simulated time in a
simulated federation (server/virtual_clock.py). The coordinator is given one and calls it only through
:class:`RoundClock`."""

from __future__ import annotations

from typing import Protocol, Sequence

import grpc

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.server.config import CoordinatorConfig
from fedpar.server.rounds import Refusal, RoundState
from fedpar.server.virtual_clock import VirtualClock


class LetGo(Protocol):
    """Whom a clock tells that held tasks may go ahead (the member source: server/members.py)."""

    def let_go(self, agent_ids: Sequence[str]) -> None:
        """The members of ``agent_ids`` may now download, train and upload."""


class RoundClock(Protocol):
    """What a round asks of its clock (every method runs on the coordinator's event loop)."""

    def open_round(self, state: RoundState) -> None:
        """The round's tasks are about to go out."""

    async def choose(self, state: RoundState, members: LetGo) -> None:
        """Once the tasks are out, decide who of the sampled trains (and tell ``members``)."""

    def record(self, state: RoundState | None, agent_id: str, task_id: str, seconds: float) -> None:
        """One member's reported finish time for its held task."""

    def stamp(self, task: pb.TrainTask) -> None:
        """Add the clock's fields to a task handed out."""

    def stamp_reply(self, reply: pb.PullHostTasksReply) -> None:
        """Add the clock's fields to a simulation host's reply."""

    def finish_round(self) -> dict:
        """The round ended: the clock's columns of its metrics row."""

    def state(self) -> dict:
        """The clock's entries of the checkpoint (JSON)."""

    def restore(self, state: dict) -> None:
        """Take the clock's entries of a checkpoint's state (ValueError/TypeError if damaged)."""


class WallClock:
    """Real time: every sampled agent trains; the straggler deadline is in real seconds (server/deadline.py)."""

    def open_round(self, state: RoundState) -> None:
        """Nothing is held in real time."""

    async def choose(self, state: RoundState, members: LetGo) -> None:
        """Every sampled agent trains."""

    def record(self, state: RoundState | None, agent_id: str, task_id: str, seconds: float) -> None:
        """A Refusal: only a virtual clock takes finish times."""
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                      "finish estimates sent, but this coordinator runs in real time (no --clock virtual)")

    def stamp(self, task: pb.TrainTask) -> None:
        """A real-time task carries only its deadline."""

    def stamp_reply(self, reply: pb.PullHostTasksReply) -> None:
        """Nothing to add in real time."""

    def finish_round(self) -> dict:
        """No columns in real time."""
        return {}

    def state(self) -> dict:
        """Nothing to checkpoint."""
        return {}

    def restore(self, state: dict) -> None:
        """Nothing to restore."""


def clock_for(config: CoordinatorConfig) -> RoundClock:
    """The clock ``config`` asks for (``--clock``)."""
    if config.virtual_clock:
        return VirtualClock(config.deadline_seconds, config.round_wall_seconds)
    return WallClock()
