"""Rank 0's count of another rank's uploads (server/ranks/calls.py): one agent's, or the members of a host's
pre-summed partial, counted all together or not at all (first K, duplicates, a closed round, the wrong rank)."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.server.ranks.calls import RankCalls
from fedpar.server.rounds import AgentSlot, Refusal, RoundState


def _round(target: int, ranks: dict[str, int]) -> tuple[RankCalls, RoundState]:
    slots = {a: AgentSlot(a, f"t-{a}", rank=r) for a, r in ranks.items()}
    state = RoundState(4, target, 1, 30.0, slots)
    return RankCalls(SimpleNamespace(current=state, current_round_id=4)), state


def _count(*agents: str, count: int | None = None, round_id: int = 4) -> pb.RankUploads:
    uploads = [pb.RankUpload(round=round_id, agent_id=a, task_id=f"t-{a}", num_examples=10 + i,
                             metrics={"loss": 0.5}, upload_bytes=400) for i, a in enumerate(agents)]
    return pb.RankUploads(uploads=uploads, count=len(uploads) if count is None else count)


def test_a_partials_members_are_counted_together_and_the_round_closes_at_k():
    calls, state = _round(3, {"a": 1, "b": 1, "c": 1, "d": 1})
    calls.count(1, _count("a", "b"))
    assert (state.accepted, state.examples, state.closed) == (2, 21, False)
    assert [state.slots[a].status for a in "ab"] == ["accepted", "accepted"]
    calls.count(1, _count("c"))
    assert (state.accepted, state.closed, state.close_reason) == (3, True, "target reached")


@pytest.mark.parametrize("agents, code, says", [
    (("a", "b", "c"), grpc.StatusCode.FAILED_PRECONDITION, "closes after 2 more updates, fewer than the 3 to count; "
                                                           "send them one by one"),
    (("a", "x"), grpc.StatusCode.ALREADY_EXISTS, "'x' already sent an update"),
    (("a", "a"), grpc.StatusCode.INVALID_ARGUMENT, "names an agent twice"),
    (("a", "z"), grpc.StatusCode.FAILED_PRECONDITION, "'z' was dealt to aggregator rank 2, not 1"),
    (("a", "nobody"), grpc.StatusCode.PERMISSION_DENIED, "'nobody' was not sampled in round 4"),
], ids=["past-k", "duplicate", "twice", "other-rank", "not-sampled"])
def test_a_count_that_cannot_take_every_upload_takes_none(agents, code, says):
    calls, state = _round(3, {"a": 1, "b": 1, "c": 1, "x": 1, "z": 2})
    calls.count(1, _count("x"))
    with pytest.raises(Refusal, match=says) as refused:
        calls.count(1, _count(*agents))
    assert refused.value.code == code
    assert state.accepted == 1 and [state.slots[a].status for a in "abc"] == ["pending"] * 3
    assert state.refused == {code.name.lower(): 1}  # one refused attempt in the round's row, as at rank 0 itself


def test_a_count_whose_length_is_not_its_uploads_is_refused():
    calls, state = _round(3, {"a": 1, "b": 1})
    for uploads in (_count("a", "b", count=1), _count()):
        with pytest.raises(Refusal, match="none was applied") as refused:
            calls.count(1, uploads)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert state.accepted == 0


def test_after_the_close_every_upload_of_a_count_is_late():
    calls, state = _round(3, {"a": 1, "b": 1})
    state.close("deadline")
    with pytest.raises(Refusal, match="round 4 is closed"):
        calls.count(1, _count("a", "b"))
    assert [state.slots[a].status for a in "ab"] == ["late", "late"] and state.late_refused == 2
    assert state.refused == {"failed_precondition": 1}  # QA: a late upload through rank 1 was in no refused_ column


def test_a_lost_ranks_count_and_a_stale_rounds_are_refused():
    calls, state = _round(3, {"a": 1})
    with pytest.raises(Refusal, match="upload for round 3, but the current round is 4"):
        calls.count(1, _count("a", round_id=3))
    calls.drop([1], None)
    with pytest.raises(Refusal, match="aggregator rank 1 was declared lost"):
        calls.count(1, _count("a"))
    assert state.accepted == 0
