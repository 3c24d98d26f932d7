"""The upload intake on its own: the coordinator is entered twice per upload (open, accept), limits and staging
slots are always given back, a final refusal rejects while any other end leaves the agent free to retry, and a staging
buffer exists only while a staging slot is held."""

from __future__ import annotations

import asyncio
import gc

import grpc
import numpy as np
import pytest

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout
from fedpar.server.config import CoordinatorConfig
from fedpar.server.limits import Limits
from fedpar.server.registry import AgentRecord
from fedpar.server.rounds import AgentSlot, Refusal, RoundState, UploadTicket
from fedpar.server.uploads import UploadIntake

LAYOUT = ModelLayout.of_arrays(["w"], [np.zeros(4, np.float32)])
AGENT = AgentRecord("a", "token", 10)


class FakeCoordinator:
    """Records what the intake asks of it; refuses to open when told to."""

    def __init__(self, refuse_open: Refusal | None = None, refuse_accept: Refusal | None = None, **config):
        self.config = CoordinatorConfig(**config)
        self.calls: list[tuple] = []
        self.refuse_open, self.refuse_accept = refuse_open, refuse_accept
        self.state = RoundState(1, 1, 1, 30.0, {a: AgentSlot(a, "t") for a in "ab"})

    def open_upload(self, agent, header):
        self.calls.append(("open_upload", agent.agent_id))
        if self.refuse_open is not None:
            raise self.refuse_open
        slot = self.state.slots[agent.agent_id]
        slot.status = "uploading"
        return UploadTicket(self.state, slot, 10, {}, LAYOUT, mode=None)

    async def accept(self, ticket, arrays):
        self.calls.append(("accept", [a.tolist() for a in arrays]))
        if self.refuse_accept is not None:
            raise self.refuse_accept


def _intake(coord: FakeCoordinator) -> UploadIntake:
    return UploadIntake(coord, Limits(coord.config, LAYOUT.total_bytes))


def _held(intake: UploadIntake) -> tuple[dict, int]:
    return dict(intake.limits._calls), intake.limits._queued_uploads


def _send(values):
    async def receive(upload):
        upload.write(0, np.asarray(values, np.float32).tobytes())
    return receive


def test_an_accepted_upload_enters_the_coordinator_twice_and_holds_nothing_after():
    coord = FakeCoordinator()
    intake = _intake(coord)
    reply = asyncio.run(intake.take(AGENT, None, _send([1, 2, 3, 4])))
    assert reply.accepted and reply.message == "update accepted for round 1"
    assert coord.calls == [("open_upload", "a"), ("accept", [[1.0, 2.0, 3.0, 4.0]])]
    assert _held(intake) == ({}, 0) and intake.staging_slots.free == coord.config.max_concurrent_uploads


@pytest.mark.parametrize("values, final", [([1, np.nan, 3, 4], True), ([1, 2], False)])
def test_bad_content_is_final_and_a_short_upload_is_not(values, final):
    coord = FakeCoordinator()
    intake = _intake(coord)

    async def receive(upload):
        upload.write(0, np.asarray(values, np.float32).tobytes())
        if not upload.staging.complete:  # what the gRPC stream says when it ends early
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "stream ended early")
    with pytest.raises(Refusal) as err:
        asyncio.run(intake.take(AGENT, None, receive))
    assert err.value.final is final
    assert coord.calls == [("open_upload", "a")]  # nothing reached accept
    assert coord.state.slots["a"].status == ("rejected" if final else "pending")  # settled on the ticket
    assert coord.state.rejected == int(final)
    assert _held(intake) == ({}, 0) and intake.staging_slots.free == coord.config.max_concurrent_uploads
    if final:
        assert "'w' contains NaN or Inf; update refused" in err.value.message


def test_a_refused_open_leaves_no_limit_held_and_a_ticket_mismatch_is_refused_after_the_limits():
    coord = FakeCoordinator(refuse_open=Refusal(grpc.StatusCode.FAILED_PRECONDITION, "round closed"))
    intake = _intake(coord)
    with pytest.raises(Refusal, match="round closed"):
        intake.open(AGENT, None)
    assert _held(intake) == ({}, 0) and coord.calls == [("open_upload", "a")]

    coord = FakeCoordinator(max_upload_attempts_per_round=1)
    intake = _intake(coord)
    header = pb.UploadHeader(round=1, task_id="other")
    with pytest.raises(Refusal, match="but the ticket is for round 1 task 't'"):
        intake.open(AGENT, header, issued=(1, "t"))
    assert coord.calls == [] and _held(intake) == ({}, 0)
    upload = intake.open(AGENT, pb.UploadHeader(round=1, task_id="t"), issued=(1, "t"))  # the mismatch held nothing
    intake.settle(upload, None)  # broke off: retryable, but the attempt counted
    assert coord.state.slots["a"].status == "pending"
    with pytest.raises(Refusal, match="--max-upload-attempts"):
        intake.open(AGENT, pb.UploadHeader(round=1, task_id="t"), issued=(1, "t"))
    assert _held(intake) == ({}, 0) and coord.state.slots["a"].status == "pending"  # the refusal settled its ticket


def test_a_vanished_agent_is_settled_as_retryable_and_staging_waits_for_a_slot():
    async def scenario():
        coord = FakeCoordinator(max_concurrent_uploads=1, max_queued_uploads=4)
        intake = _intake(coord)
        release = asyncio.Event()

        async def slow(upload):
            await release.wait()
            upload.write(0, np.zeros(4, np.float32).tobytes())
        first = asyncio.ensure_future(intake.take(AGENT, None, slow))
        await asyncio.sleep(0.01)
        second = intake.open(AgentRecord("b", "token", 10), None)
        waiting = asyncio.ensure_future(intake.reserve_staging(second, lambda: None, 5.0))
        await asyncio.sleep(0.01)
        assert not waiting.done() and second._staging is None  # no model copy before a slot is free
        first.cancel()  # the first agent goes away mid-upload
        with pytest.raises(asyncio.CancelledError):
            await first
        hold = await asyncio.wait_for(waiting, 1.0)
        assert coord.state.slots["a"].status == "pending"  # not final: the agent may upload again
        intake.release_staging(hold)
        intake.settle(second, None)
        assert _held(intake) == ({}, 0)
    asyncio.run(scenario())


def test_a_refused_upload_leaves_no_reference_cycle():
    """A refusal's traceback holds the intake's frame; a cycle through it would keep each refused call's request
    and staging alive until a rare full gc collection (the coordinator's PSS slope in benchmarks/soak.py)."""
    coord = FakeCoordinator()
    intake = _intake(coord)

    async def closed(upload):
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "round 1 is closed; the update was not applied")

    async def refused_uploads():
        for _ in range(3):
            try:
                await intake.take(AGENT, None, closed)
            except Refusal:
                pass
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable stays in gc.garbage to be looked at
    try:
        asyncio.run(refused_uploads())
        gc.collect()
        cyclic = [o for o in gc.garbage if isinstance(o, Refusal)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert coord.state.refused == {"failed_precondition": 3}
    assert cyclic == []
