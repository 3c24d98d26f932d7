"""A real population host (client/runtime.py hosting simulations/population.py's members, as `fedpar
simulate-workers` does) against a coordinator that lies (tests/support/hostile_coordinator.py: real gRPC on
127.0.0.1): whatever it sends, the host refuses or skips it in one line, trains nothing twice or on garbage, does not
crash, spin or print a peer's escapes, and goes on training the well-formed tasks."""

from __future__ import annotations

import pytest

from fedpar.protocol import fedpar_pb2 as pb
from tests.support.hostile_coordinator import HostileHostCoordinator, HostRun, host_tasks, weights_of

pytestmark = pytest.mark.timeout(60)


def _answered(count: int):
    """Done once ``count`` members' updates or failures reached the coordinator."""
    return lambda c: len(c.uploaded()) + sum(len(p.failures) for p in c.pulls) >= count


def _hosted(coordinator: HostileHostCoordinator, script, seconds: float = 10.0, **kw) -> HostRun:
    """A host against ``coordinator``, given the replies ``script(run)`` makes (from its members and model)."""
    run = HostRun(coordinator, **kw)
    for reply in script(run):
        coordinator.replies.put(reply)
    try:
        return run.run(seconds)
    finally:
        coordinator.stop()


def _clean(run: HostRun) -> None:
    """The host ended on the coordinator's word, with nothing raised anywhere and no traceback logged."""
    assert run.error is None and run.thread_errors == [], (run.error, run.thread_errors, run.text)
    assert "Traceback" not in run.text and "host-0: coordinator says: done" in run.lines, run.text


def test_tasks_for_members_the_host_does_not_hold_are_skipped_and_the_others_trained():
    """An id the host does not hold ended the host with a KeyError, a non-numeric one with a ValueError; another
    prefix on a held number ('evil-0001') was trained as client-0001."""
    coordinator = HostileHostCoordinator(done_when=_answered(2))
    run = _hosted(coordinator, lambda run: [
        host_tasks(run.layout, weights_of(run.layout, 0.01), ["client-0099", "bob", "evil-0001", "client-1",
                                                               "client-\x1b[2J", run.members[0]]),
        host_tasks(run.layout, weights_of(run.layout, 0.01), [run.members[1]], round_id=2)])
    _clean(run)
    assert sorted(coordinator.uploaded()) == run.members[:2]
    assert "the coordinator handed out 5 tasks for members this host does not hold (e.g. client-0099); skipped" \
        in run.text, run.text
    assert all(not p.failures for p in coordinator.pulls)  # the coordinator refuses failures of members not the host's


def test_a_member_named_twice_or_handed_its_task_again_trains_it_once():
    """The old host trained and uploaded a member's task once for each time the coordinator named it."""
    coordinator = HostileHostCoordinator(done_when=lambda c: len(c.pulls) >= 4)
    run = _hosted(coordinator, lambda run: [
        host_tasks(run.layout, weights_of(run.layout, 0.01), [run.members[0]] * 3 + [run.members[1]]),
        host_tasks(run.layout, weights_of(run.layout, 0.01), [run.members[0]])])
    _clean(run)
    assert sorted(coordinator.uploaded()) == run.members[:2]
    assert "handed out 2 tasks to members named twice, or again with a task they took (e.g. client-0000)" \
        in run.text, run.text
    assert "handed out 1 task to members named twice, or again with a task they took" in run.text, run.text


@pytest.mark.parametrize("clock", [
    dict(clock_seconds=float("nan"), clock_deadline_seconds=10.0),
    dict(clock_seconds=-5.0, clock_deadline_seconds=10.0),
    dict(clock_seconds=float("inf"), clock_deadline_seconds=10.0),
    dict(clock_seconds=0.0, clock_deadline_seconds=float("nan")),
    dict(clock_seconds=0.0, clock_deadline_seconds=float("inf")),
], ids=["nan-time", "negative-time", "inf-time", "nan-deadline", "inf-deadline"])
def test_a_virtual_clock_task_at_a_time_no_clock_reads_is_refused_and_told(clock):
    """An infinite time or deadline ended the host with an OverflowError; NaN ones reported a NaN finish time and
    trained on."""
    coordinator = HostileHostCoordinator(done_when=_answered(1))
    run = _hosted(coordinator, lambda run: [
        host_tasks(run.layout, weights_of(run.layout, 0.01), run.members[:1], virtual_clock=True, **clock),
        pb.PullHostTasksReply(go=run.members[:1], virtual_clock=True, clock_seconds=1.0)])
    _clean(run)
    assert coordinator.uploaded() == []
    assert all(not p.finish_estimates for p in coordinator.pulls)
    told = [f for p in coordinator.pulls for f in p.failures]
    assert [(f.agent_id, f.task_id) for f in told] == [(run.members[0], f"{run.members[0]}-r1")], told
    assert told[0].reason.startswith("task refused: the task's simulated time"), told


def test_a_virtual_clock_task_of_billions_of_steps_is_capped_and_trained():
    """4e9 local epochs under a 1e9 s simulated deadline: the old host's step cap overflowed TrainTask.max_steps
    (uint32) and ended it with a ValueError."""
    coordinator = HostileHostCoordinator(done_when=_answered(1))
    run = _hosted(coordinator, lambda run: [
        host_tasks(run.layout, weights_of(run.layout, 0.01), run.members[:1], virtual_clock=True, clock_seconds=0.0,
                   clock_deadline_seconds=1e9, local_epochs=4_000_000_000, learning_rate=1e-9, deadline_seconds=1.5),
        pb.PullHostTasksReply(go=run.members[:1], virtual_clock=True, clock_seconds=1.0)], seconds=20)
    _clean(run)
    assert [e.seconds > 0 for p in coordinator.pulls for e in p.finish_estimates] == [True]
    assert coordinator.uploaded() == run.members[:1]


@pytest.mark.parametrize("after", [
    pb.PullHostTasksReply(virtual_clock=True, clock_seconds=1.0),
    pb.PullHostTasksReply(go=["client-0099"]),
    pb.PullHostTasksReply(virtual_clock=True, clock_seconds=float("nan")),
], ids=["same-time", "go-for-no-task", "nan-time"])
def test_a_coordinator_that_answers_every_pull_at_once_is_pulled_at_a_backoff(after):
    """The old host pulled some 5000 times a second while each reply said the simulated time again (or let go a
    task it did not hold)."""
    coordinator = HostileHostCoordinator(after=after)
    run = _hosted(coordinator, lambda run: [], seconds=2)
    assert run.error is None and run.thread_errors == [] and "Traceback" not in run.text, run.text
    assert 3 <= len(coordinator.pulls) < 40, len(coordinator.pulls)


def test_what_the_coordinator_says_of_an_upload_is_logged_as_one_printable_line():
    """A refused partial's reason of 1000 lines and terminal escapes: the old host logged every line of it."""
    said = "no\n\x1b[2J" * 1000
    # done once both members' own uploads came: after a refused partial the host sends each on its own; members that
    # finish apart (the 16-core GPU box) are sent on their own at once
    coordinator = HostileHostCoordinator(done_when=lambda c: sum(len(b.uploads) for b in c.uploads) >= 2,
                                         upload_reply=lambda request: (
        pb.HostUploadResults(results=[pb.HostUploadResult(code=9, message=said)] * len(request.uploads),
                             partial=pb.HostUploadResult(code=9, message=said))))
    run = _hosted(coordinator, lambda run: [host_tasks(run.layout, weights_of(run.layout, 0.01), run.members[:2])])
    _clean(run)
    partials = [b for b in coordinator.uploads if b.partial.member_ids]
    own = [u.header.auth.agent_id for b in coordinator.uploads for u in b.uploads]
    assert sorted(own) == sorted(run.members[:2]) and len(partials) <= 1, coordinator.uploads
    if partials:
        assert "a partial of 2 updates was refused (no ?" in run.text, run.text
    assert "sent in the background were refused" in run.text or "a partial of 2" in run.text, run.text
    assert not [line for line in run.lines if "\x1b" in line or "\n" in line or len(line) > 700], run.text


def test_a_join_reply_without_a_chunk_size_means_the_default_and_updates_go_in_batches():
    """max_chunk_bytes 0: the old host sent every update on its own UploadUpdate stream (none is small below 1 byte)."""
    coordinator = HostileHostCoordinator(done_when=_answered(2),
                                         join_reply=pb.JoinPopulationReply(host_token="h", max_chunk_bytes=0))
    run = _hosted(coordinator, lambda run: [host_tasks(run.layout, weights_of(run.layout, 0.01), run.members[:2])])
    _clean(run)
    assert sorted(coordinator.uploaded()) == run.members[:2]


@pytest.mark.parametrize("join_reply, said", [
    (pb.JoinPopulationReply(host_token="", max_chunk_bytes=1 << 20),
     "answered the join without a session token: is it a fedpar coordinator?"),
    (pb.JoinPopulationReply(host_token="h", max_chunk_bytes=(1 << 32) - 1),
     "answered the join with chunks of 4294967295 bytes: they must be at most 67108864"),
    (b"\xff\xff\xff", "coordinator refused: INTERNAL: Exception deserializing response!"),
], ids=["no-token", "chunks-past-the-channel", "unparsable"])
def test_a_join_reply_the_host_cannot_work_with_ends_it_in_one_line(join_reply, said):
    """Chunks of 4 GiB: the old host took whole updates of up to 4 GiB as small ones, for one message each."""
    coordinator = HostileHostCoordinator(join_reply=join_reply)
    run = _hosted(coordinator, lambda run: [])
    assert type(run.error).__name__ == "FatalAgentError" and str(run.error).endswith(said), run.error
    assert coordinator.pulls == [] and run.thread_errors == [] and "Traceback" not in run.text, run.text


def test_a_task_whose_settings_cannot_be_read_is_refused_and_told_and_the_next_round_trains():
    """Settings that are not JSON, or ask for what no member can do: the old runtime refused the task in one line but
    told no one, so the round waited out its deadline for updates that would not come."""
    coordinator = HostileHostCoordinator(done_when=_answered(3))
    run = _hosted(coordinator, lambda run: [
        host_tasks(run.layout, weights_of(run.layout, 0.01), run.members[:1], extra_json="{{"),
        host_tasks(run.layout, weights_of(run.layout, 0.01), run.members[1:2], extra_json='{"proximal_mu": -1}'),
        host_tasks(run.layout, weights_of(run.layout, 0.01), run.members[:1], round_id=2)])
    _clean(run)
    told = {f.agent_id: f.reason for p in coordinator.pulls for f in p.failures}
    assert sorted(told) == run.members[:2] and all(r.startswith("task refused: the task") for r in told.values()), told
    assert coordinator.uploaded() == run.members[:1]


def _garbled(reply: pb.PullHostTasksReply, how: str) -> pb.PullHostTasksReply:
    """``reply`` with its round's weights spoilt ``how``."""
    if how == "short":
        reply.weights = reply.weights[:100]
    elif how == "shape":
        reply.weights_header.tensors[0].shape[:] = [3, 3]
    elif how == "escapes":
        reply.weights_header.tensors[0].dtype = "\x1b[2J\n" * 100
    return reply


@pytest.mark.parametrize("how", ["short", "shape", "escapes", "nan"])
def test_a_round_model_that_is_not_the_hosts_is_refused_told_and_the_next_round_trains(how):
    """Weights cut short, of another shape, of a dtype of escapes, or NaN: refused in one printable line each and
    told as the members' failures, never trained."""
    coordinator = HostileHostCoordinator(done_when=_answered(3))
    run = _hosted(coordinator, lambda run: [
        _garbled(host_tasks(run.layout, weights_of(run.layout, float("nan") if how == "nan" else 0.01),
                            run.members[:2]), how),
        host_tasks(run.layout, weights_of(run.layout, 0.01), run.members[2:3], round_id=2)])
    _clean(run)
    told = {f.agent_id: f.reason for p in coordinator.pulls for f in p.failures}
    said = "model does not fit the coordinator's: " if how == "shape" else "download refused: "
    assert sorted(told) == run.members[:2] and all(r.startswith(said) for r in told.values()), told
    assert coordinator.uploaded() == run.members[2:3]
    assert not [line for line in run.lines if "\x1b" in line or "\n" in line], run.text
