"""The upload intake on its own: an upload is checked against the open round and handed to its mode (admit,
accept), not to the coordinator; limits and staging slots are always given back, a final refusal rejects while any other end leaves the agent free to retry, and a staging
buffer exists only while a staging slot is held."""

from __future__ import annotations

import asyncio
import gc

import grpc
import numpy as np
import pytest

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout, layout_to_pb
from fedpar.server.config import CoordinatorConfig
from fedpar.server.limits import Limits
from fedpar.server.registry import AgentRecord
from fedpar.server.rounds import AgentSlot, Refusal, RoundState
from fedpar.server.uploads import UploadIntake

LAYOUT = ModelLayout.of_arrays(["w"], [np.zeros(4, np.float32)])
AGENT = AgentRecord("a", "token", 10)


def _header(task_id: str = "t") -> pb.UploadHeader:
    """A valid header of round 1 for LAYOUT."""
    return pb.UploadHeader(round=1, task_id=task_id, num_examples=10, total_bytes=LAYOUT.total_bytes,
                           tensors=layout_to_pb(LAYOUT))


class FakeMode:
    """A round mode that takes the plain LAYOUT, recording whom it admits and what it accepts; refuses to admit or
    accept when told to."""

    def __init__(self, calls: list[tuple], refuse_admit: Refusal | None, refuse_accept: Refusal | None):
        self.calls, self.refuse_admit, self.refuse_accept = calls, refuse_admit, refuse_accept

    def admit(self, agent_id):
        self.calls.append(("admit", agent_id))
        if self.refuse_admit is not None:
            raise self.refuse_admit

    def expected_layout(self, header):
        return LAYOUT, "the global model"

    async def decoded(self, global_weights, arrays):
        return arrays

    async def accept(self, state, ticket, arrays):
        self.calls.append(("accept", [a.tolist() for a in arrays]))
        if self.refuse_accept is not None:
            raise self.refuse_accept
        state.count_accepted(ticket.slot)


class FakeCoordinator:
    """An aggregator rank's open round (round 1, agents a and b) under a :class:`FakeMode`, which records what the
    intake asks of it."""

    rank = 0
    runs_rounds = True

    def __init__(self, refuse_open: Refusal | None = None, refuse_accept: Refusal | None = None, **config):
        self.config = CoordinatorConfig(**config)
        self.calls: list[tuple] = []
        self.state = self.current = RoundState(1, 1, 1, 30.0, {a: AgentSlot(a, "t") for a in "ab"})
        self.mode = FakeMode(self.calls, refuse_open, refuse_accept)
        self.weights = [np.zeros(4, np.float32)]


def _intake(coord: FakeCoordinator) -> UploadIntake:
    return UploadIntake(coord, Limits(coord.config, LAYOUT.total_bytes))


def _held(intake: UploadIntake) -> tuple[dict, int]:
    return dict(intake.limits._calls), intake.queued


def _send(values):
    async def receive(upload):
        upload.write(0, np.asarray(values, np.float32).tobytes())
    return receive


def test_an_accepted_upload_is_admitted_by_the_rounds_mode_then_accepted_and_holds_nothing_after():
    coord = FakeCoordinator()
    intake = _intake(coord)
    reply = asyncio.run(intake.take(AGENT, _header(), _send([1, 2, 3, 4])))
    assert reply.accepted and reply.message == "update accepted for round 1"
    assert coord.calls == [("admit", "a"), ("accept", [[1.0, 2.0, 3.0, 4.0]])]
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
        asyncio.run(intake.take(AGENT, _header(), receive))
    assert err.value.final is final
    assert coord.calls == [("admit", "a")]  # nothing reached accept
    assert coord.state.slots["a"].status == ("rejected" if final else "pending")  # settled on the ticket
    assert coord.state.rejected == int(final)
    assert _held(intake) == ({}, 0) and intake.staging_slots.free == coord.config.max_concurrent_uploads
    if final:
        assert "'w' contains NaN or Inf; update refused" in err.value.message


def test_a_refused_open_leaves_no_limit_held_and_a_ticket_mismatch_is_refused_after_the_limits():
    coord = FakeCoordinator(refuse_open=Refusal(grpc.StatusCode.FAILED_PRECONDITION, "round closed"))
    intake = _intake(coord)
    with pytest.raises(Refusal, match="round closed"):
        intake.open(AGENT, _header())
    assert _held(intake) == ({}, 0) and coord.calls == [("admit", "a")]

    coord = FakeCoordinator(max_upload_attempts_per_round=1)
    intake = _intake(coord)
    header = _header("other")
    with pytest.raises(Refusal, match="but the ticket is for round 1 task 't'"):
        intake.open(AGENT, header, issued=(1, "t"))
    assert coord.calls == [] and _held(intake) == ({}, 0)
    upload = intake.open(AGENT, _header(), issued=(1, "t"))  # the mismatch held nothing
    intake.settle(upload, None)  # broke off: retryable, but the attempt counted
    assert coord.state.slots["a"].status == "pending"
    with pytest.raises(Refusal, match="--max-upload-attempts"):
        intake.open(AGENT, _header(), issued=(1, "t"))
    assert _held(intake) == ({}, 0) and coord.state.slots["a"].status == "pending"  # the refusal settled its ticket


def test_a_vanished_agent_is_settled_as_retryable_and_staging_waits_for_a_slot():
    async def scenario():
        coord = FakeCoordinator(max_concurrent_uploads=1, max_queued_uploads=4)
        intake = _intake(coord)
        release = asyncio.Event()

        async def slow(upload):
            await release.wait()
            upload.write(0, np.zeros(4, np.float32).tobytes())
        first = asyncio.ensure_future(intake.take(AGENT, _header(), slow))
        await asyncio.sleep(0.01)
        second = intake.open(AgentRecord("b", "token", 10), _header())
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
                await intake.take(AGENT, _header(), closed)
            except Refusal:
                pass
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable stays in gc.garbage to be looked at
    try:
        asyncio.run(refused_uploads())
        gc.collect()
        # only this test's refusals: a data plane another test in this worker left is cyclic garbage of its own
        # (its accept thread's target is its own method) and holds its one shared handshake refusal
        cyclic = [o for o in gc.garbage if isinstance(o, Refusal) and o.message.startswith("round 1 is closed")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert coord.state.refused == {"failed_precondition": 3}
    assert cyclic == []
