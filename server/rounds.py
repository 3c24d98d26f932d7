"""The state of one round: who was sampled, what arrived, when it closes, and what each aggregator rank took in it (the
metrics row's per-rank columns)."""

from __future__ import annotations

import asyncio
import logging
import resource
import secrets
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol, Sequence

import grpc
import numpy as np

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout
from fedpar.protocol.round_refusals import CAME_TOO_LATE, round_closed
from fedpar.protocol.task_settings import TaskSettings
from fedpar.server.deadline import TARGET_REACHED, closing_reason

log = logging.getLogger("fedpar.server")
RunUpdate = Callable[..., Awaitable]  # runs fn(*args) for one update, on the event loop or a worker thread
# the statuses an upload may be refused with (a round's refused_<status> columns): each a code some Refusal uses
UPLOAD_REFUSALS = ("aborted", "already_exists", "deadline_exceeded", "failed_precondition", "invalid_argument",
                   "permission_denied", "resource_exhausted", "unauthenticated", "unavailable")


# the statuses of a slot whose task may be handed to a new process of its member (server/coordinator.py)
REOPENABLE = ("pending", "lost")


# A status message travels percent-encoded in a trailer that peers drop past 16 KiB (then the agent hears "metadata
# size exceeds hard limit", not why it was refused): at most 12 bytes a character, so 1,024 characters always fit.
MAX_REFUSAL_CHARS = 1024


class Refusal(Exception):
    """A request the coordinator refuses, with the gRPC status to send and a message for the agent."""

    def __init__(self, code: grpc.StatusCode, message: str, final: bool = False,
                 trailing: tuple[tuple[str, str], ...] = ()):
        message = fitting(message)
        super().__init__(message)
        self.code = code
        self.message = message
        self.final = final  # the update itself is bad: the agent may not retry this round
        self.trailing = trailing  # metadata sent with the refusal, for the agent's code to read


def fitting(message: str) -> str:
    """``message`` cut in the middle to MAX_REFUSAL_CHARS, keeping its start (what) and end (what to do)."""
    if len(message) <= MAX_REFUSAL_CHARS:
        return message
    half = (MAX_REFUSAL_CHARS - 5) // 2
    return f"{message[:half]} ... {message[-half:]}"


def not_this_round(what: str, round_id: int, current: int, applied: str = "; the update was not applied") -> Refusal:
    """The Refusal of ``what`` (an upload, a reply) sent for round ``round_id`` while round ``current`` is open (or
    was the last): it came too late, or is of a run that ended or started over (a service's next run counts its
    rounds from 1 again), which the agent is told rather than left to wonder at a round number from the past."""
    why = (CAME_TOO_LATE if round_id <= current else  # (<=: between rounds, ``current`` is the last one)
           "the run it was for ended or started over (a service's next run, or a coordinator restarted without its "
           "checkpoint, counts rounds from 1)")
    return Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                   f"{what} for round {round_id}, but the current round is {current}: {why}{applied}")


@dataclass
class AgentSlot:
    """One sampled agent's task and what became of it."""

    agent_id: str
    task_id: str
    rank: int = 0  # the aggregator rank that takes its download and upload (server/ranks/)
    dispatched: bool = False
    downloaded: bool = False  # a download of the round's weights completed; the task is not handed out again
    data_ticket: bytes | None = None  # its data-plane ticket, issued once however often the task is handed out
    # pending | uploading | accepted | rejected | late | lost (it or its aggregator rank went silent)
    status: str = "pending"
    upload_bytes: int = 0  # tensor bytes of its upload as it crosses the wire (compressed or not)
    message: bytes = b""  # a Flower App run's Message for it (server/flower_rounds.py): its task carries no weights
    go: bool = True  # under the virtual clock, False until it is among the first K to finish (server/virtual_clock.py)


@dataclass
class RoundState:
    """Bookkeeping for one round; mutated only on the coordinator's event loop."""

    round_id: int
    target: int  # K: accepted updates that close the round early
    min_reports: int
    deadline_seconds: float
    slots: dict[str, AgentSlot]
    started: float = field(default_factory=time.monotonic)
    model_id: str = field(default_factory=lambda: secrets.token_hex(8))  # the round's global model, as tasks name it
    closed: bool = False
    close_reason: str = ""
    accepted: int = 0
    rejected: int = 0
    late_refused: int = 0
    examples: int | None = 0  # None: hidden (a secure round under DP, whose agents each weigh 1)
    metrics: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    pending_folds: set = field(default_factory=set)
    fold_seconds: float = 0.0  # spent folding this round's updates on this rank
    fold_groups: int = 0  # folds into the strategy on this rank (each a group of the updates that waited)
    fold_group_max: int = 0  # the most updates one of them took
    download_bytes: int = 0  # model bytes sent to agents this round (inline in tasks, or completed downloads)
    refused: dict[str, int] = field(default_factory=dict)  # upload refusals by gRPC status, e.g. resource_exhausted
    training_failures: int = 0  # sampled agents whose own code failed their task (rejected, with no update)
    training_error: str = ""  # the first one's reason, e.g. "training raised TypeError: ..."
    refused_updates: int = 0  # updates refused for what they held (rejected, but for training failures)
    refusal: str = ""  # the first refused update's reason, e.g. "tensor 'w' contains NaN or Inf; update refused"
    failure: str = ""  # why the round fails whatever it accepted (its fold or its secure aggregation failed)
    closed_event: asyncio.Event = field(default_factory=asyncio.Event)
    on_reject: Callable[[AgentSlot, str], None] | None = None  # told of each refused update (aggregator ranks)
    # asked before updates are counted: (state, their slots, their (examples, metrics) reports); a Refusal leaves
    # them all uncounted (aggregator ranks: rank 0 counts them first, all or none)
    on_count: Callable[[RoundState, list[AgentSlot], list[tuple[int, dict[str, float]]]], Awaitable[None]] | None \
        = None
    answering: int | None = None  # sampled agents that may still answer (virtual clock: the chosen); None: all
    # done before this round counts an update: the previous round's checkpoint and metrics line, written while this
    # round's tasks go out and its members train (server/coordinator.py); None: nothing to wait for
    counts_after: asyncio.Future | None = None

    @property
    def sampled(self) -> int:
        """M, the number of agents given this round's task."""
        return len(self.slots)

    @property
    def closes_at(self) -> float:
        """The time.monotonic() at which the round's deadline passes: ``deadline_seconds`` (the deadline policy's,
        server/deadline.py) after its tasks went out."""
        return self.started + self.deadline_seconds

    @property
    def upload_bytes(self) -> int:
        """Tensor bytes of this round's accepted uploads, as they crossed the wire."""
        return sum(s.upload_bytes for s in self.slots.values() if s.status == "accepted")

    def slot_for(self, agent_id: str, task_id: str, held_ok: bool = False) -> AgentSlot:
        """The slot of an agent in this round, or a Refusal saying why it has none (or why it may not download or
        upload yet: a task the virtual clock holds, unless ``held_ok``)."""
        slot = self.slots.get(agent_id)
        if slot is None:
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                          f"agent {agent_id!r} was not sampled in round {self.round_id}")
        if task_id != slot.task_id:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"task {task_id[:64]!r} is not the current task of {agent_id!r} in round {self.round_id}")
        if not (slot.go or held_ok):
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"agent {agent_id!r} is not among the first to finish round {self.round_id} in simulated "
                          "time (virtual clock): it does not train this round")
        return slot

    def check_open(self) -> None:
        """Raise a Refusal if the round has closed."""
        if self.closed:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, round_closed(self.round_id, self.close_reason))

    def note_refusal(self, refusal: Refusal) -> None:
        """Count one refused upload attempt under its status (a busy agent retrying counts once per attempt)."""
        reason = refusal.code.name.lower()
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def close(self, reason: str) -> None:
        """Close the round: later uploads are refused."""
        if not self.closed:
            self.closed = True
            self.close_reason = reason
            self.closed_event.set()

    def fail(self, reason: str) -> None:
        """The round fails for ``reason`` (one line; the first one given is kept), whatever it accepted."""
        self.failure = self.failure or reason

    def failed_because(self) -> str:
        """Why the round failed ('' if it did not): its own failure, else too few accepted updates."""
        if self.failure:
            return self.failure
        if self.accepted < self.min_reports:
            return f"{self.accepted} accepted updates < --min-reports {self.min_reports}"
        return ""

    def close_if_done(self) -> None:
        """Close if the deadline policy says so now (server/deadline.py: first K, or every sampled agent that may
        still answer answered)."""
        answering = len(self.slots) if self.answering is None else self.answering  # O(1): called on every upload
        reason = closing_reason(self.accepted, self.rejected, self.target, answering)
        if reason:
            self.close(reason)

    def refuse_if_closed(self, *slots: AgentSlot) -> None:
        """A Refusal for the complete updates of ``slots`` if the round has closed since they began (each counted
        as late)."""
        if self.closed:
            for slot in slots:
                slot.status = "late"
            self.late_refused += len(slots)
            self.check_open()

    async def ready_to_count(self) -> None:
        """Wait until this round may count an update: :attr:`counts_after` is done (what it raised is the
        coordinator's to report, not this upload's)."""
        if self.counts_after is not None and not self.counts_after.done():
            await asyncio.wait([self.counts_after])

    def count_accepted(self, slot: AgentSlot, report: tuple[int, dict[str, float]] | None = None) -> None:
        """Count ``slot``'s update as accepted, with its (examples, metrics) report if the round may see one."""
        slot.status = "accepted"
        self.accepted += 1
        if report is not None:
            examples, metrics = report
            if metrics.get("eval_examples", 0) > examples:  # an agent's say in the round's evaluation is at most its
                metrics["eval_examples"] = float(examples)  # say in its model (one that said 1e99 outweighed all)
            self.examples += examples
            self.metrics.append(report)

    def withdraw(self, report: tuple[int, dict[str, float]]) -> None:
        """Undo :meth:`count_accepted` of an update the strategy then refused (its slot is rejected next)."""
        self.accepted -= 1
        self.examples -= report[0]
        self.metrics.remove(report)

    def reject(self, slot: AgentSlot, message: str) -> None:
        """Record a refused update (bad content); it never touches the model. The round's first is said; the others
        (a diverged run refuses every client's) at debug level, counted in one line when the round ends."""
        self.refused_updates += 1
        self.refusal = self.refusal or message
        log.log(logging.WARNING if self.refused_updates == 1 else logging.DEBUG,
                "round %d: rejected update from %s: %s", self.round_id, slot.agent_id, message)
        self._answered_without_update(slot, message)

    def _answered_without_update(self, slot: AgentSlot, message: str) -> None:
        slot.status = "rejected"
        self.rejected += 1
        if self.on_reject is not None:
            self.on_reject(slot, message)
        self.close_if_done()

    def lose(self, agent_ids: Sequence[str]) -> None:
        """``agent_ids``, sampled, went silent before they answered (their liveness ran out): none of them will answer,
        so the round need not wait out its deadline for them (each counts as late)."""
        lost = [slot for agent_id in agent_ids if (slot := self.slots.get(agent_id)) is not None
                and slot.status == "pending" and (self.answering is None or slot.go)]
        if not lost or self.closed:
            return
        for slot in lost:
            slot.status = "lost"
        self.answering = (len(self.slots) if self.answering is None else self.answering) - len(lost)
        log.info("round %d: %d sampled agent(s) went silent before answering (%s)", self.round_id, len(lost),
                 ", ".join(slot.agent_id for slot in lost[:5]) + (", ..." if len(lost) > 5 else ""))
        self.close_if_done()

    def reopen(self, slots: Sequence[AgentSlot]) -> None:
        """``slots``' tasks go to new processes of their members (their old ones were killed): each is handed out
        anew, and one counted lost (its liveness ran out first) may answer again."""
        for slot in slots:
            if slot.status == "lost":
                slot.status = "pending"
                if self.answering is not None:  # (a lost one was counted out of it)
                    self.answering += 1
            slot.dispatched = slot.downloaded = False

    def fail_restarted(self, slots: Sequence[AgentSlot]) -> None:
        """``slots``' members' processes were killed and their tasks cannot be handed to the new ones: none of them
        will answer, so the round need not wait out its deadline for them (each counts as late, as :meth:`lose`
        counts them; the coordinator says why)."""
        failed = [slot for slot in slots if slot.status == "pending" and (self.answering is None or slot.go)]
        if not failed or self.closed:
            return
        for slot in failed:
            slot.status = "lost"
        self.answering = (len(self.slots) if self.answering is None else self.answering) - len(failed)
        self.close_if_done()

    def training_failed(self, slot: AgentSlot, reason: str) -> None:
        """Record a sampled agent whose own code failed its task (``reason``: one line): it answered with no update,
        rejected as a refused update is, and said once in the round's log line rather than once per agent."""
        self.training_failures += 1
        self.training_error = self.training_error or reason
        log.info("round %d: %s answered with no update: its %s", self.round_id, slot.agent_id, reason)
        self._answered_without_update(slot, f"its {reason}")

    def late(self) -> int:
        """Sampled agents whose update arrived after the round closed (refused)."""
        return sum(1 for s in self.slots.values() if s.status == "late")

    def unanswered(self, reason: str) -> dict[str, int]:
        """The row's counts of the sampled agents that never answered the round, closed for ``reason`` (its row's
        close_reason): ``not_needed``, those still to answer when it reached its target (the surplus sampled beyond
        K), and ``silent``, the others (they dropped out, died, or were still training at its deadline)."""
        waiting = [s for s in self.slots.values() if s.status not in ("accepted", "rejected", "late")]
        surplus = sum(1 for s in waiting if s.status != "lost") if reason == TARGET_REACHED else 0
        return {"silent": len(waiting) - surplus, "not_needed": surplus}


@dataclass
class UploadTicket:
    """An upload whose header passed validation; its data is still to come."""

    state: RoundState
    slot: AgentSlot
    num_examples: int
    metrics: dict[str, float]
    layout: ModelLayout  # what the data must fill: the model, its compressed encoding, or the masked vector
    mode: RoundMode  # the round's mode, which decodes and folds the update

    def settle(self, refused: Refusal | None) -> None:
        """The end of the upload: a final refusal rejects the update (it never touches the model); any other
        end that left it unaccepted (refusal, disconnect, truncation) lets the agent try again this round."""
        if refused is not None and refused.final:
            self.state.reject(self.slot, refused.message)
        elif self.slot.status == "uploading":
            self.slot.status = "pending"


class RoundMode(Protocol):
    """What sets a kind of round apart (plain, compressed, secure: server/round_modes.py, server/secure_round.py).

    The coordinator keeps the round policy (sampling, the deadline, first-K, the accounting) and asks the
    round's mode the rest. Every method runs on the coordinator's event loop.
    """

    redelivers_tasks: bool  # whether a task whose download was lost may be handed out again

    def task_settings(self, settings: TaskSettings) -> TaskSettings:
        """``settings`` (the strategy's) with what this mode adds for every task."""

    def start(self, state: RoundState) -> None:
        """The round opened."""

    def admit(self, agent_id: str) -> None:
        """Refuse, before the header is checked further, an upload this round takes from no such agent."""

    def expected_layout(self, header: pb.UploadHeader) -> tuple[ModelLayout, str]:
        """The layout the upload's tensors must have and what a refusal calls it; a Refusal for a wrong encoding."""

    async def decoded(self, global_weights: Sequence[np.ndarray], arrays: list[np.ndarray]) -> list[np.ndarray]:
        """The update a complete upload stands for (a final Refusal if its content is invalid)."""

    async def accept(self, state: RoundState, ticket: UploadTicket, arrays: list[np.ndarray]) -> None:
        """Count the update in ``state`` and add it to the round's sum (a Refusal if it cannot be)."""

    async def close(self, state: RoundState, global_weights: Sequence[np.ndarray]) -> None:
        """The round closed: finish combining its accepted updates, so the strategy can finish the round."""

    def metrics(self) -> dict:
        """This mode's columns of the round's metrics row."""


# per-rank ingest columns of the metrics row: uploads, their bytes, fold seconds, folds (each a group of the updates
# that waited: server/round_modes.py FoldQueue) and the most updates one took, peak memory
STAT_NAMES = ("uploads", "bytes", "fold_s", "fold_groups", "fold_group_max", "peak_mib")


def rank_columns(world: int) -> list[tuple[str, str]]:
    """The progress table's per-rank ingest columns (uploads and fold seconds) for ``world`` ranks."""
    return [col for r in range(world) for col in ((f"r{r}_uploads", "{:>10.0f}"), (f"r{r}_fold_s", "{:>9.3f}"))]


def ingest_stats(state: RoundState, rank: int) -> list[float]:
    """What ``rank`` took in this round (the columns of STAT_NAMES): accepted uploads, their bytes, seconds spent
    folding, the folds and the most updates one took, and the process's peak resident memory so far in MiB."""
    mine = [s for s in state.slots.values() if s.rank == rank and s.status == "accepted"]
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    return [float(len(mine)), float(sum(s.upload_bytes for s in mine)), state.fold_seconds, float(state.fold_groups),
            float(state.fold_group_max), peak_mib]
