"""A real `fedpar client` against a coordinator that lies (tests/support/hostile_coordinator.py: real gRPC on
127.0.0.1): whatever it sends, the agent refuses or skips it in one line, trains nothing on garbage, uploads nothing
it should not, does not spin, and Ctrl-C still stops it."""

from __future__ import annotations

import re

import grpc
import numpy as np
import pytest

from fedpar.protocol import fedpar_pb2 as pb
from tests.support.hostile_coordinator import (HostileCoordinator, digits_layout, inline_task, run_agent,
                                              run_agents_interrupted, weights_of)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def layout():
    """The agent's model, as the coordinator announces it."""
    return digits_layout()


def _served(coordinator: HostileCoordinator, tmp_path, **kw) -> tuple[int, str]:
    """Run the agent against ``coordinator``, then stop it (given ``capfd``, the agent's main in this process)."""
    try:
        return run_agent(coordinator, tmp_path, **kw)
    finally:
        coordinator.stop()


def _log_lines(out: str) -> list[str]:
    """What the agent said, without its --insecure warning."""
    return [line for line in out.splitlines() if "fedpar.security" not in line]


def test_a_task_whose_knobs_would_train_garbage_is_refused_in_one_line_and_told(layout, tmp_path, capfd):
    """A NaN, negative or zero learning rate, no epochs or empty batches, a NaN or endless deadline: the old agent
    trained NaN weights and uploaded them (or called a zero batch size its own training's failure)."""
    bad = [dict(learning_rate=float("nan")), dict(learning_rate=-1.0), dict(learning_rate=0.0), dict(batch_size=0),
           dict(local_epochs=0), dict(deadline_seconds=float("nan")), dict(deadline_seconds=float("inf")),
           dict(round_id=2 ** 64 - 1), dict(ingest_port=70000), dict(ingest_port=9, ingest_host="a\nb")]  # its shuffle's seed overflowed, said as the member's own training failing
    coordinator = HostileCoordinator([inline_task(layout, weights_of(layout, 0.01), task_id=f"t{n}", **knobs)
                                      for n, knobs in enumerate(bad)])
    code, out = _served(coordinator, tmp_path, capfd=capfd)
    assert code == 1 and "Traceback" not in out, out  # it took part in no round: its supervisor is to know
    assert _log_lines(out)[-1] == ("fedpar client: a: none of its 10 tasks ended in an update the coordinator took "
                                   "(the first: round 1 task: the task's learning rate must be a finite number > 0, "
                                   "got nan)"), out
    assert coordinator.uploads == [], out
    refused = [line for line in _log_lines(out) if re.search(r"round \d+ task refused: the task", line)]
    assert len(refused) == len(bad), out
    told = [(p.finished_task_id, p.failure) for p in coordinator.pulls[1:]]
    assert [task for task, _ in told] == [f"t{n}" for n in range(len(bad))], told
    assert all(failure.startswith("task refused: the task") for _, failure in told), told


def test_training_that_diverges_is_not_uploaded(layout, tmp_path, capfd):
    """A finite learning rate so large that training overflows: the old agent uploaded the Inf/NaN weights."""
    coordinator = HostileCoordinator([inline_task(layout, weights_of(layout, 0.01), learning_rate=1e38)])
    code, out = _served(coordinator, tmp_path, capfd=capfd)
    assert code == 1 and "Traceback" not in out, out  # its one task failed here: said last, as its exit code says
    assert _log_lines(out)[-1].startswith("fedpar client: a: none of its 1 task ended in an update the coordinator "
                                          "took (the first: round 1 task: training failed: "), out
    assert coordinator.uploads == [], out
    said = "training failed: task 'mlp on digits': the training loss is nan (lr 1e+38): training diverged (lower --lr)"
    assert f"round 1 task refused: {said}" in out, out
    told = [(p.finished_task_id, p.failure) for p in coordinator.pulls[1:] if p.finished_task_id]
    assert told and told[0][1].startswith(said), told  # the round need not wait


def test_reply_bytes_that_do_not_parse_cost_one_line_not_a_traceback(layout, tmp_path, capfd):
    """A download chunk, then a PullTask reply, that are not protobuf: gRPC logged the traceback of the parse."""
    task = pb.TrainTask(round=1, task_id="t", deadline_seconds=20, local_epochs=1, batch_size=16, learning_rate=0.1)
    header = pb.ModelChunk(header=pb.ModelHeader(round=1, total_bytes=layout.total_bytes))
    header.header.tensors.extend(inline_task(layout, weights_of(layout)).task.weights_header.tensors)
    coordinator = HostileCoordinator([pb.PullTaskReply(task=task), b"\xff\xff\xff\xff"],
                                     download=lambda request: [header, b"\x12\x05\xff\xff\xff\xff\xff"])
    code, out = _served(coordinator, tmp_path, capfd=capfd)
    assert "Traceback" not in out and "deserializing message" not in out, out
    assert "a: download refused: INTERNAL: Exception deserializing response!" in out, out
    assert code == 1 and _log_lines(out)[-1] == "fedpar client: a: coordinator refused: INTERNAL: Exception " \
                                                "deserializing response!", out


class _ForgetsEverySession(HostileCoordinator):
    """Joins the agent, then says it does not know the session, for ever."""

    def _pull(self, request, context):
        self.pulls.append(request)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown session")


class _AnswersAtOnce(HostileCoordinator):
    """Ends every long-poll at once with ``reply`` (a wait, or a task the agent refuses)."""

    def __init__(self, reply: pb.PullTaskReply):
        super().__init__()
        self.reply = reply

    def _pull(self, request, context):
        self.pulls.append(request)
        return self.reply


ANSWERING_AT_ONCE = {
    "forgets-every-session": lambda layout: _ForgetsEverySession(),
    "answers-every-poll-at-once": lambda layout: _AnswersAtOnce(pb.PullTaskReply(wait_seconds=0)),
    "hands-out-only-refused-tasks": lambda layout: _AnswersAtOnce(inline_task(layout, weights_of(layout),
                                                                              extra_json="{{")),
}


@pytest.fixture(scope="module")
def answered_at_once(layout, tmp_path_factory) -> dict[str, tuple[HostileCoordinator, int, str]]:
    """Each coordinator of ANSWERING_AT_ONCE with its own real agent process, the three side by side, each agent
    sent Ctrl-C 4 s after it was first heard: the coordinator, the agent's exit code and its output, by name."""
    coordinators = {name: make(layout) for name, make in ANSWERING_AT_ONCE.items()}
    try:
        ended = run_agents_interrupted(list(coordinators.values()), tmp_path_factory.mktemp("at-once"))
    finally:
        for coordinator in coordinators.values():
            coordinator.stop()
    return {name: (coordinator, *result) for (name, coordinator), result in zip(coordinators.items(), ended)}


@pytest.mark.parametrize("name", list(ANSWERING_AT_ONCE))
def test_a_coordinator_that_answers_at_once_is_called_at_a_backoff_and_ctrl_c_stops_the_agent(name, answered_at_once):
    """The old agent joined, or pulled, thousands of times a second (a core at 100 %, a log line each)."""
    coordinator, code, out = answered_at_once[name]
    assert code == 130 and "interrupted after" in out and "Traceback" not in out, out
    # at most --max-backoff 0.5 s apart once backed off: some tens in the seconds after joining, not thousands
    assert 3 <= len(coordinator.pulls) < 40, (len(coordinator.pulls), out[-2000:])
    assert coordinator.joins < 40 and len(_log_lines(out)) < 50, out[-2000:]


def test_a_join_reply_without_a_session_token_ends_the_agent_in_one_line(tmp_path, capfd):
    """The old agent pulled with the empty token (and, refused, joined again at once, for ever)."""
    coordinator = HostileCoordinator(join_reply=pb.JoinReply(token="", heartbeat_seconds=5))
    code, out = _served(coordinator, tmp_path, capfd=capfd)
    assert code == 1 and "Traceback" not in out, out
    assert _log_lines(out)[-1].endswith("answered the join without a session token: is it a fedpar coordinator?"), out
    assert coordinator.pulls == []


@pytest.mark.parametrize("seconds", [float("nan"), -1.0, 1e300])
def test_a_join_reply_with_a_heartbeat_interval_no_clock_can_wait_ends_the_agent_in_one_line(seconds, tmp_path, capfd):
    """NaN or a negative interval made the heartbeat thread spin on calls that expired before they left (none
    reached the coordinator, whose liveness check then counts the agent gone); 1e300 killed the thread with an
    OverflowError traceback as training began."""
    coordinator = HostileCoordinator(join_reply=pb.JoinReply(token="t", heartbeat_seconds=seconds))
    code, out = _served(coordinator, tmp_path, capfd=capfd)
    assert code == 1 and "Traceback" not in out, out
    assert f"answered the join with a heartbeat interval of {seconds} s" in _log_lines(out)[-1], out


def test_what_the_coordinator_says_is_logged_as_one_printable_line(tmp_path, capfd):
    """A 10 KB shutdown reason of many lines and terminal escapes: the old agent printed every line of it."""
    coordinator = HostileCoordinator([pb.PullTaskReply(shutdown_reason="bye\n\x1b[2J" * 2000)])
    code, out = _served(coordinator, tmp_path, capfd=capfd)
    assert code == 0 and "\x1b" not in out, out[:2000]
    said = [line for line in out.splitlines() if "coordinator says: " in line]
    assert len(said) == 1 and len(said[0].split("coordinator says: ", 1)[1]) <= 500, out[:2000]
    assert len(out.splitlines()) <= 4, out[:2000]


def test_a_task_handed_out_again_after_the_agent_finished_it_is_not_trained_again(layout, tmp_path, capfd):
    """The old agent trained the same task twice and uploaded a second update for it."""
    task = inline_task(layout, weights_of(layout, 0.01), task_id="once")
    coordinator = HostileCoordinator([task, task])
    code, out = _served(coordinator, tmp_path, capfd=capfd)
    assert code == 0 and "Traceback" not in out, out
    assert len(coordinator.uploads) == 1, out
    assert "handed out task once of round 1 again, which this agent is done with; skipped" in out, out


def test_a_new_task_of_a_round_seen_before_trains_from_the_weights_it_carries(layout, tmp_path, capfd):
    """A service's next run counts rounds from 1 again with the same sessions: the old agent trained run B's round 3
    from run A's round-3 model, kept from before, ignoring the weights inside run B's task."""
    coordinator = HostileCoordinator([
        inline_task(layout, weights_of(layout, 0.01), round_id=3, task_id="run-a", learning_rate=1e-9),
        inline_task(layout, weights_of(layout, 0.5), round_id=3, task_id="run-b", learning_rate=1e-9)])
    code, out = _served(coordinator, tmp_path, capfd=capfd)
    assert code == 0 and len(coordinator.uploads) == 2, out
    means = [float(np.frombuffer(u.data, np.float32)[:1000].mean()) for u in coordinator.uploads]
    assert means == pytest.approx([0.01, 0.5], abs=1e-3), means


class _RestartedBeforeTheUpload(HostileCoordinator):
    """Forgets the agent's session between handing out its task and its upload, as a coordinator restarted."""

    def _upload_small(self, request, context):
        self.uploads.append(request)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown agent 'a': call Join first")


def test_an_update_refused_by_a_restarted_coordinator_is_not_counted_as_refused(layout, tmp_path, capfd):
    """After a service's restart the agent logged 'upload refused: UNAUTHENTICATED: unknown agent ...: call Join first'
    and counted a refusal (QA): the update of a round the coordinator forgot is not used, and the agent joins again."""
    coordinator = _RestartedBeforeTheUpload([inline_task(layout, weights_of(layout, 0.01))])
    code, out = _served(coordinator, tmp_path, capfd=capfd, more=("--log-level", "info"))
    assert code == 0 and len(coordinator.uploads) == 1, out
    assert "round 1's update was not used: the coordinator no longer knows this agent's session (it restarted); " \
           "joining again" in out, out
    assert "upload refused" not in out and "1 update accepted, 0 refused" not in out, out
    assert "0 updates accepted, 0 refused" in out, out
