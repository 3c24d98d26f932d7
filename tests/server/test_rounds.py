"""Rounds over real gRPC: weighted FedAvg, stragglers, killed agents, failed rounds, big models, resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout

ROOT = Path(__file__).resolve().parents[2]


def _weights(seed=0, shapes=((20, 30), (30,), (30, 5))):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _names(weights):
    return [f"t{i}" for i in range(len(weights))]


def _weighted_mean(updates, counts):
    total = float(sum(counts))
    return [sum(np.float64(n) * u[i].astype(np.float64) for u, n in zip(updates, counts)) / total
            for i in range(len(updates[0]))]


def test_three_agents_produce_the_weighted_mean(start_coordinator, agents):
    init = _weights()
    server = start_coordinator(init, clients_per_round=3, min_available=3)
    bots = agents(server.address, ["a", "b", "c"])
    layout = ModelLayout.of_arrays(_names(init), init)
    counts = [10, 25, 65]
    updates = [_weights(seed) for seed in (1, 2, 3)]
    for bot, update, n in zip(bots, updates, counts):
        task = bot.task()
        got = bot.download(task, layout)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got, init))
        assert bot.upload(task, update, n).accepted
    assert server.wait(30)
    row = server.coordinator.metrics.last
    assert (row["status"], row["sampled"], row["reported"], row["late"]) == ("ok", 3, 3, 0)
    expected = _weighted_mean(updates, counts)
    for new, exp in zip(server.coordinator.weights, expected):
        assert new.dtype == np.float32
        np.testing.assert_allclose(new, exp, rtol=1e-6, atol=1e-7)
    # `fedpar serve` stops lingering once every agent live at the end has heard that training is over
    for bot in bots:
        assert not server.coordinator.everyone_told_finished()
        assert bot.shutdown_reason() == "training finished after round 1"
    assert server.coordinator.everyone_told_finished()


def test_straggler_past_the_deadline_is_excluded_and_refused(start_coordinator, agents):
    init = _weights()
    server = start_coordinator(init, clients_per_round=3, min_available=3, deadline_seconds=3.0)
    fast1, fast2, slow = agents(server.address, ["fast1", "fast2", "slow"])
    updates, counts = [_weights(4), _weights(5)], [30, 70]
    tasks = {bot.agent_id: bot.task() for bot in (fast1, fast2, slow)}
    for bot, update, n in zip((fast1, fast2), updates, counts):
        assert bot.upload(tasks[bot.agent_id], update, n).accepted
    assert server.wait(20)  # closes at the deadline without the straggler
    with pytest.raises(grpc.RpcError) as err:
        slow.upload(tasks["slow"], _weights(6), 50)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "closed" in err.value.details() and "not applied" in err.value.details()
    row = server.coordinator.metrics.last
    # still training when the round closed (its row was written before its upload came): silent, not late
    assert (row["status"], row["reported"], row["late"], row["silent"], row["close_reason"]) == \
        ("ok", 2, 0, 1, "deadline")
    for new, exp in zip(server.coordinator.weights, _weighted_mean(updates, counts)):
        np.testing.assert_allclose(new, exp, rtol=1e-6, atol=1e-7)


KILLED_AGENT = textwrap.dedent("""
    import sys, time
    import grpc, numpy as np
    from fedpar.protocol import fedpar_pb2 as pb
    from fedpar.protocol.codec import CoordinatorStub, ModelLayout
    from fedpar.client.transfer import upload_messages
    stub = CoordinatorStub(grpc.insecure_channel(sys.argv[1]))
    token = stub.Join(pb.JoinRequest(agent_id="doomed", num_examples=100)).token
    auth = pb.AgentAuth(agent_id="doomed", token=token)
    while True:
        reply = stub.PullTask(pb.PullTaskRequest(auth=auth, wait_seconds=1.0))
        if reply.WhichOneof("kind") == "task":
            break
    arrays = [np.full(s, 1e6, np.float32) for s in [(20, 30), (30,), (30, 5)]]
    layout = ModelLayout.of_arrays(["t0", "t1", "t2"], arrays)
    def stream():
        for i, m in enumerate(upload_messages(auth, reply.task, layout, arrays, 100, 1, {}, 512)):
            yield m
            if i == 3:
                print("MID-UPLOAD", flush=True)
                time.sleep(600)
    stub.UploadUpdate(stream())
""")


def test_agent_killed_mid_upload_leaves_the_model_untouched(start_coordinator, agents):
    init = _weights()
    server = start_coordinator(init, clients_per_round=3, min_available=3, deadline_seconds=6.0)
    a, b = agents(server.address, ["a", "b"])
    proc = subprocess.Popen([sys.executable, "-c", KILLED_AGENT, server.address], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "MID-UPLOAD"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert all(x.tobytes() == y.tobytes() for x, y in zip(server.coordinator.weights, init))
        updates, counts = [_weights(7), _weights(8)], [40, 60]
        for bot, update, n in zip((a, b), updates, counts):
            assert bot.upload(bot.task(), update, n).accepted
        assert server.wait(20)
    finally:
        proc.kill()
    row = server.coordinator.metrics.last
    assert (row["status"], row["reported"], row["late"], row["silent"]) == ("ok", 2, 0, 1)  # killed: it never answered
    for new, exp in zip(server.coordinator.weights, _weighted_mean(updates, counts)):
        np.testing.assert_allclose(new, exp, rtol=1e-6, atol=1e-7)


def test_too_few_reports_fail_the_round_and_keep_the_model(start_coordinator, agents):
    init = _weights()
    server = start_coordinator(init, rounds=2, clients_per_round=2, min_available=2, min_reports=2,
                               deadline_seconds=1.5)
    a, _ = agents(server.address, ["a", "b"])
    assert a.upload(a.task(), _weights(9), 10).accepted
    assert server.wait(20)
    rows = list(server.coordinator.metrics.read_rows())
    assert [r["status"] for r in rows] == ["failed", "failed"]
    assert rows[0]["reported"] == 1
    assert all(x.tobytes() == y.tobytes() for x, y in zip(server.coordinator.weights, init))


def test_100mb_model_round_trips_bit_exact(start_coordinator, agents):
    rng = np.random.default_rng(0)
    init = [rng.standard_normal(25_000_000, dtype=np.float32)]
    server = start_coordinator(init, clients_per_round=1, min_available=1, max_chunk_bytes=4 << 20,
                               deadline_seconds=120)
    (bot,) = agents(server.address, ["big"])
    bot.max_chunk = 4 << 20
    task = bot.task()
    got = bot.download(task, ModelLayout.of_arrays(["t0"], init))
    assert got[0].tobytes() == init[0].tobytes()
    update = [got[0] + np.float32(0.5)]
    assert bot.upload(task, update, 1, timeout=120).accepted
    assert server.wait(60)
    assert server.coordinator.weights[0].tobytes() == update[0].tobytes()


def test_checkpoint_resumes_after_the_last_completed_round(start_coordinator, agents, tmp_path):
    init = _weights()
    ckpt = tmp_path / "ckpt"
    server = start_coordinator(init, clients_per_round=1, min_available=1, checkpoint_dir=ckpt)
    (a,) = agents(server.address, ["a"])
    update = _weights(11)
    assert a.upload(a.task(), update, 10).accepted
    assert server.wait(20)
    server.stop()
    after_round_1 = server.coordinator.weights
    for x, y in zip(after_round_1, update):
        np.testing.assert_allclose(x, y, rtol=1e-6)
    # a short liveness timeout: the resumed coordinator waits that long for agent a, which never comes back
    resumed = start_coordinator(init, rounds=2, clients_per_round=1, min_available=1, checkpoint_dir=ckpt,
                                liveness_timeout_seconds=1.5)
    assert resumed.coordinator.round_id == 1
    assert all(x.tobytes() == y.tobytes() for x, y in zip(resumed.coordinator.weights, after_round_1))
    (b,) = agents(resumed.address, ["b"])
    task = b.task()
    assert task.round == 2
    downloaded = b.download(task, ModelLayout.of_arrays(_names(init), init))
    assert all(x.tobytes() == y.tobytes() for x, y in zip(downloaded, after_round_1))


def test_a_task_whose_reply_or_download_was_lost_is_handed_out_again_until_a_download_completes(
        start_coordinator, agents):
    # 40 MB: more than the transport buffers, so the coordinator is still sending when the download breaks off.
    init = [np.random.default_rng(0).standard_normal(10_000_000, dtype=np.float32)]
    server = start_coordinator(init, clients_per_round=1, min_available=1, deadline_seconds=20.0)
    (bot,) = agents(server.address, ["a"])
    layout = ModelLayout.of_arrays(_names(init), init)
    lost = bot.task()  # the reply "never arrived": the agent pulls again
    again = bot.task()
    assert (again.round, again.task_id) == (lost.round, lost.task_id)
    stream = bot.stub.DownloadWeights(pb.DownloadRequest(auth=bot.auth, round=again.round, task_id=again.task_id),
                                      timeout=10)
    next(stream)
    stream.cancel()  # the download broke off after its first message
    task = bot.task()
    assert task.task_id == lost.task_id
    got = bot.download(task, layout)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got, init))
    reply = bot.stub.PullTask(pb.PullTaskRequest(auth=bot.auth, wait_seconds=1.0), timeout=10)
    assert reply.WhichOneof("kind") != "task"  # downloaded: the task is not repeated
    update = [init[0] + np.float32(1.0)]
    assert bot.upload(task, update, 1).accepted
    assert server.wait(20)
    row = server.coordinator.metrics.last
    assert (row["status"], row["sampled"], row["reported"]) == ("ok", 1, 1)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(server.coordinator.weights, update))


def test_an_agent_that_stopped_answering_is_not_sampled(start_coordinator, agents):
    from fedpar.server.coordinator import cohort_digest

    init = _weights()
    server = start_coordinator(init, clients_per_round=2, min_available=2, liveness_timeout_seconds=1.0,
                               heartbeat_seconds=0.5)
    (silent,) = agents(server.address, ["c"])  # joins, then never calls again
    time.sleep(1.5)
    a, b = agents(server.address, ["a", "b"])
    for bot, n in ((a, 10), (b, 30)):
        assert bot.upload(bot.task(), _weights(n), n).accepted
    assert server.wait(20)
    row = server.coordinator.metrics.last
    assert (row["status"], row["sampled"], row["reported"]) == ("ok", 2, 2)
    assert row["cohort_digest"] == cohort_digest(["a", "b"])
    assert server.coordinator.registry.live_ids() == ["a", "b"]


def test_a_sampled_agent_that_goes_silent_does_not_hold_the_round_to_its_deadline(start_coordinator, agents):
    """One of two sampled agents takes its task and dies (no heartbeat, no upload): once its liveness runs out the
    round closes with the other's update, long before the 60 s deadline (it waited all of it)."""
    init = _weights()
    server = start_coordinator(init, clients_per_round=2, min_available=2, min_reports=1, deadline_seconds=60.0,
                               liveness_timeout_seconds=1.5, heartbeat_seconds=0.5)
    alive, dead = agents(server.address, ["alive", "dead"])
    dead.task()  # and never calls again
    started = time.monotonic()
    assert alive.upload(alive.task(), _weights(3), 30).accepted
    assert server.wait(20)
    row = server.coordinator.metrics.last
    assert (row["status"], row["sampled"], row["reported"], row["late"], row["silent"]) == ("ok", 2, 1, 0, 1), row
    assert row["close_reason"] == "every sampled agent answered"
    assert time.monotonic() - started < 10
    np.testing.assert_allclose(server.coordinator.weights[0], _weights(3)[0], rtol=1e-6)


def test_a_rounds_first_refused_update_is_said_and_the_others_are_counted_quietly(caplog):
    """A diverged run refuses every client's update: it printed one warning per client per round (QA round 3)."""
    import logging

    from fedpar.server.rounds import AgentSlot, RoundState

    state = RoundState(1, 3, 1, 30.0, {a: AgentSlot(a, "t") for a in "abc"})
    with caplog.at_level(logging.DEBUG, logger="fedpar.server"):
        for agent_id in "abc":
            state.reject(state.slots[agent_id], f"tensor 'w' of {agent_id} contains NaN or Inf; update refused")
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "rejected update" in r.getMessage()]
    assert [level for level, _ in said] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert state.rejected == 3 and state.refusal == "tensor 'w' of a contains NaN or Inf; update refused"


def test_rounds_with_fewer_live_agents_than_k_go_on_and_say_so_once(start_coordinator, agents, caplog):
    """A trace's quiet hours (or --min-available below K) leave fewer agents to sample than a round asks for: the
    rounds go on with those there are, and a warning says so once (QA: the real clock said nothing where the virtual
    clock refuses the run)."""
    import logging

    caplog.set_level(logging.WARNING, logger="fedpar.server")
    server = start_coordinator(_weights(), rounds=2, clients_per_round=3, min_available=2, deadline_seconds=30)
    a, b = agents(server.address, ["a", "b"])
    for round_id in (1, 2):
        for bot, seed in ((a, 1), (b, 2)):
            assert bot.upload(bot.task(), _weights(seed), 10).accepted
    assert server.wait(20)
    assert [r["sampled"] for r in server.coordinator.metrics.read_rows()] == [2, 2]
    said = [r.getMessage() for r in caplog.records if "live to sample" in r.getMessage()]
    assert said == ["round 1: 2 agents live to sample, fewer than the 3 a round asks for: rounds go on with those "
                    "there are (each row's 'sampled' says how many)"], said
