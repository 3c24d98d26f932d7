"""Rank 0's answers to the other ranks' RankControl calls (server/ranks/control.py), on the coordinator's loop:
rank 0 alone counts uploads (first K, deadline, duplicates), whichever rank took them. A rank declared lost is
refused from then on, and the uploads it took in the open round are no longer counted (its partial sum is gone)."""

from __future__ import annotations

import time

import grpc

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.server.rounds import AgentSlot, Refusal, RoundState, not_this_round


class RankCalls:
    """What rank 0 does with each RankControl call of rank ``rank``: the coordinator's round takes the counts,
    refusals and downloads; :attr:`heard` keeps each rank's last heartbeat."""

    def __init__(self, coordinator):
        self.coordinator = coordinator
        self.heard: dict[int, float] = {}  # monotonic time of each other rank's last heartbeat
        self.lost: set[int] = set()  # ranks declared lost: their calls are refused
        self._counted: dict[str, tuple[int, dict[str, float]]] = {}  # the open round's counted reports, by agent
        self._counted_round = 0

    def _slot(self, rank: int, round_id: int, agent_id: str, task_id: str) -> tuple[RoundState, AgentSlot]:
        """The open round's slot a rank's call is about (a Refusal if the round is not current, or the agent was
        dealt to another rank)."""
        if rank in self.lost:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"aggregator rank {rank} was declared lost; the update was not applied")
        state = self.coordinator.current
        if state is None or round_id != state.round_id:
            raise not_this_round("upload", round_id, self.coordinator.current_round_id)
        slot = state.slot_for(agent_id, task_id)
        if slot.rank != rank:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"agent {slot.agent_id!r} was dealt to aggregator rank {slot.rank}, not {rank}")
        return state, slot

    def count(self, rank: int, uploads: pb.RankUploads) -> None:
        """Complete, checked uploads at ``rank`` (one agent's, or the members of a host's pre-summed partial): count
        them all (first K, deadline, duplicates) or refuse them all, counting none. A refusal is one refused upload
        attempt in the open round's row (``refused_<status>``), as an upload rank 0 took itself would be: the other
        rank's own count of it never reaches the row."""
        try:
            self._count(rank, uploads)
        except Refusal as refusal:
            if self.coordinator.current is not None:
                self.coordinator.current.note_refusal(refusal)
            raise

    def _count(self, rank: int, uploads: pb.RankUploads) -> None:
        """:meth:`count`, its refusals not yet noted."""
        if uploads.count != len(uploads.uploads) or not uploads.uploads:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"a Count of {len(uploads.uploads)} uploads said it "
                                                            f"holds {uploads.count}; none was applied")
        if len({u.agent_id for u in uploads.uploads}) != len(uploads.uploads):
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "a Count names an agent twice; none was applied")
        slots = [self._slot(rank, u.round, u.agent_id, u.task_id) for u in uploads.uploads]
        state = slots[0][0]
        for _, slot in slots:
            if slot.status in ("accepted", "rejected", "late"):
                raise Refusal(grpc.StatusCode.ALREADY_EXISTS,
                              f"agent {slot.agent_id!r} already sent an update in round {state.round_id} "
                              f"({slot.status}); duplicates are refused")
        state.refuse_if_closed(*(slot for _, slot in slots))
        if state.accepted + len(slots) > state.target:  # first K counts updates one by one: those past K are late
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"round {state.round_id} closes after {state.target - state.accepted} more updates, fewer "
                          f"than the {len(slots)} to count; send them one by one")
        if self._counted_round != state.round_id:
            self._counted, self._counted_round = {}, state.round_id
        for upload, (_, slot) in zip(uploads.uploads, slots):
            slot.upload_bytes = upload.upload_bytes
            self._counted[slot.agent_id] = report(upload)
            state.count_accepted(slot, report(upload))
        state.close_if_done()

    def reject(self, rank: int, rejection: pb.RankRejection) -> None:
        """``rank`` refused an update for good (its content, or its strategy after rank 0 counted it)."""
        state, slot = self._slot(rank, rejection.round, rejection.agent_id, rejection.task_id)
        if slot.status == "accepted" and rejection.HasField("counted"):  # counted already: take the count back
            state.withdraw(report(rejection.counted))
        if slot.status in ("pending", "uploading", "accepted"):
            state.reject(slot, rejection.reason)

    def drop(self, ranks: list[int], state: RoundState | None) -> int:
        """Refuse ``ranks``' calls from now on; their slots in ``state`` (the open round, if any) are lost, and the
        uploads they had counted are counted no more. Returns how many were."""
        self.lost.update(ranks)
        if state is None:
            return 0
        dropped = silenced = 0
        for slot in state.slots.values():
            if slot.rank not in ranks or slot.status in ("rejected", "late"):
                continue
            if slot.status == "accepted":
                state.withdraw(self._counted[slot.agent_id])
                dropped += 1
            slot.status = "lost"
            silenced += slot.go
        # they will not answer: the round closes once the others have (or by first K, or its deadline)
        state.answering = (len(state.slots) if state.answering is None else state.answering) - silenced
        if not state.closed:
            state.close_if_done()
        return dropped

    def take_back(self, ranks: list[int]) -> None:
        """``ranks`` (replacements of lost ranks) are in the group again: their calls are taken from now on."""
        self.lost.difference_update(ranks)
        for rank in ranks:
            self.heard[rank] = time.monotonic()  # its heartbeat starts once it has the start message

    def downloaded(self, rank: int, download: pb.RankDownload) -> None:
        """``rank`` served an agent its task's whole model."""
        self.coordinator.download_completed(download.agent_id, download.round, download.task_id)

    def alive(self, rank: int, _: pb.RankAlive) -> None:
        """``rank``'s heartbeat."""
        self.heard[rank] = time.monotonic()


def report(upload: pb.RankUpload) -> tuple[int, dict[str, float]]:
    """The (examples, metrics) report of an upload, as the round counts it."""
    return upload.num_examples, dict(upload.metrics)
