"""A population host's pre-summed partial (linear strategies): the coordinator checks it as a whole and folds it as
one weighted block, refusing a bad one with one clear message and nothing of it counted or folded; a round that
cannot take partials (a non-linear strategy, a share cap) says so and the host's updates go one by one. Real
coordinator, real gRPC over loopback; the host side is the runtime's own HostUploads and HostSum."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from fedpar.aggregation.registry import build_strategy
from fedpar.client.host_partial import HostSum
from fedpar.client.host_uploads import HostUploads
from fedpar.client.local_loop import StackRow
from fedpar.client.transfer import SmallUpdate
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout
from support.population_calls import host_stub, join_members, member_auth, pull_tasks, upload_batch

SHAPE = (8,)
LAYOUT = ModelLayout([("t0", "float32", SHAPE)])
SPEC = [pb.TensorSpec(name="t0", dtype="float32", shape=list(SHAPE))]


def _round(server, stub, hosts: dict[str, pb.JoinPopulationReply], want: int) -> dict[str, pb.TrainTask]:
    """Pull every host's tasks until ``want`` members got one."""
    tasks: dict[str, pb.TrainTask] = {}
    end = time.monotonic() + 20
    while len(tasks) < want and time.monotonic() < end:
        for host, reply in hosts.items():
            tasks.update({t.agent_id: t.task for t in pull_tasks(stub, pb.PullHostTasksRequest(
                host=pb.AgentAuth(agent_id=host, token=reply.host_token), wait_seconds=0.2), timeout=10).tasks})
    assert len(tasks) == want, tasks.keys()
    return tasks


def _partial(tasks, members, values, weights, **fields) -> pb.HostPartial:
    """A partial of ``members`` (new weights filled with ``values``) as a host's HostSum builds it, then ``fields``
    overwritten (a bad partial no honest host would send)."""
    partial = HostSum(LAYOUT, next(iter(tasks.values())).round, ["train_loss"])
    for m, v, w in zip(members, values, weights):
        partial.add(m, tasks[m].task_id, [np.full(SHAPE, v, np.float32)], w, 1, {"train_loss": 0.5}, (10, 1))
    message = partial.message()
    for name, value in fields.items():
        if isinstance(value, list):
            del getattr(message, name)[:]
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    return message


def _update(host: pb.JoinPopulationReply, member: str, task: pb.TrainTask, array: np.ndarray, weight: int = 10,
            rows: StackRow | None = None) -> SmallUpdate:
    """A member's plain update as the runtime hands it to its host's uploads: its arrays, not yet encoded."""
    return SmallUpdate(pb.UploadHeader(auth=member_auth(host, member), round=task.round, task_id=task.task_id,
                                       num_examples=weight, steps=1, tensors=SPEC, total_bytes=32),
                       LAYOUT, [array], rows)


def _send(stub, host: str, reply, partial: pb.HostPartial) -> pb.HostUploadResult:
    return upload_batch(stub, pb.HostUploads(host=pb.AgentAuth(agent_id=host, token=reply.host_token),
                                             partial=partial)).partial


def test_a_partial_counts_its_members_once_and_folds_as_their_weighted_sum_a_bad_one_is_refused_whole(
        start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, clients_per_round=5,
                               overselect=1.0, min_available=5, rounds=1)
    stub = host_stub(server)
    a = join_members(stub, "host-a", ["a0", "a1", "a2", "a3", "idle"], away=[4])  # idle: offline, never sampled
    b = join_members(stub, "host-b", ["b0"])
    tasks = _round(server, stub, {"host-a": a, "host-b": b}, 5)
    state = server.coordinator.current
    bad = {  # each refused whole: one line naming the problem, nothing counted
        "not a member of host 'host-a'": _partial(tasks, ["a0", "b0"], [1, 1], [10, 10]),
        "not sampled": _partial(tasks, ["a0", "a1"], [1, 1], [10, 10], member_ids="a0\nidle"),
        "a member (or a metric) twice": _partial(tasks, ["a0", "a1"], [1, 1], [10, 10], member_ids="a0\na0"),
        "a metric) twice": _partial(tasks, ["a0", "a1"], [1, 1], [10, 10], metric_names=["x", "x"],
                                    metric_values=[0.0] * 4),
        "num_examples=11 must be in 1..10": _partial(tasks, ["a0", "a1"], [1, 1], [10, 10], num_examples=[10, 11]),
        "contains NaN or Inf": _partial(tasks, ["a0", "a1"], [1, 1], [10, 10],
                                        data=np.full(SHAPE, np.nan, np.float32).tobytes()),
        "must be as long as its 2 member ids": _partial(tasks, ["a0", "a1"], [1, 1], [10, 10], steps=[1]),
        "the global model's tensors": _partial(tasks, ["a0", "a1"], [1, 1], [10, 10], data=b"\0" * 16),
    }
    for text, partial in bad.items():
        result = _send(stub, "host-a", a, partial)
        assert not result.accepted and text in result.message, (text, result.message)
        assert "\n" not in result.message
    assert state.accepted == 0 and all(s.status == "pending" for s in state.slots.values())
    assert server.coordinator.strategy.folded == 0
    # a0 x10 of 2.0 and a1 x5 of 8.0: their weighted mean 4.0 with weight 15, folded as one
    good = _send(stub, "host-a", a, _partial(tasks, ["a0", "a1"], [2.0, 8.0], [10, 5]))
    assert good.accepted and "2 updates accepted" in good.message, good.message
    again = _send(stub, "host-a", a, _partial(tasks, ["a1", "a2"], [1, 1], [10, 10]))
    assert again.code == grpc.StatusCode.ALREADY_EXISTS.value[0] and "'a1' already sent" in again.message
    assert _send(stub, "host-a", a, _partial(tasks, ["a2", "a3"], [0.0, 0.0], [10, 10])).accepted
    member = member_auth(b, "b0")  # the other host's member uploads on its own
    assert stub.UploadSmall(pb.SmallUpload(header=pb.UploadHeader(
        auth=member, round=tasks["b0"].round, task_id=tasks["b0"].task_id, num_examples=5, steps=1, tensors=SPEC,
        total_bytes=32, metrics={"train_loss": 0.5}), data=np.full(SHAPE, 11.0, np.float32).tobytes()), timeout=10).accepted
    assert server.wait(20)
    row = next(server.coordinator.metrics.read_rows())
    assert (row["status"], row["reported"], row["examples"], row["num_updates"]) == ("ok", 5, 40, 5.0)
    assert row["train_loss"] == pytest.approx(0.5) and row["upload_bytes"] == 5 * 32  # as if one by one
    expected = (10 * 2.0 + 5 * 8.0 + 20 * 0.0 + 5 * 11.0) / 40
    np.testing.assert_allclose(server.coordinator.weights[0], np.full(SHAPE, expected, np.float32), rtol=1e-6)


CLIENT_DP = dict(noise_multiplier=1e-6, clip_norm=100.0, population=3, clients_per_round=3, mode="client")


@pytest.mark.parametrize("strategy, kwargs, options, reason", [
    ("median", {}, {}, "not linear"),
    ("dp-fedavg", CLIENT_DP, {}, "not linear"),  # the coordinator re-clips each update and counts those within C
    ("fedavg", {}, {"max_agent_share": 0.5}, "--max-agent-share")])
def test_a_round_that_takes_no_partial_says_so_and_the_host_sends_each_update(start_coordinator, strategy, kwargs,
                                                                              options, reason):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], strategy=build_strategy(strategy, **kwargs),
                               accept_populations=True, clients_per_round=3, overselect=1.0, min_available=3,
                               rounds=1, **options)
    stub = host_stub(server)
    a = join_members(stub, "host-a", ["a0", "a1", "a2"])
    tasks = _round(server, stub, {"host-a": a}, 3)
    refused = _send(stub, "host-a", a, _partial(tasks, ["a0", "a1"], [1, 1], [10, 10]))
    assert refused.code == grpc.StatusCode.UNIMPLEMENTED.value[0] and reason in refused.message, refused.message
    uploads = HostUploads(stub, pb.AgentAuth(agent_id="host-a", token=a.host_token), max_bytes=1 << 20, linger=0.5,
                          registered=lambda member: (10, 1))
    try:
        for i, m in enumerate(sorted(tasks)):
            uploads.send_later(stub, _update(a, m, tasks[m], np.full(SHAPE, float(i), np.float32)), 10.0)
    finally:
        uploads.close()
    assert server.wait(20)
    assert not uploads.partials and uploads.partials_sent == 0 and uploads.refused_in_background == 0
    row = next(server.coordinator.metrics.read_rows())
    assert (row["status"], row["reported"]) == ("ok", 3)
    np.testing.assert_allclose(server.coordinator.weights[0], np.full(SHAPE, 1.0, np.float32), atol=1e-4)


def test_a_host_sums_its_checked_updates_into_one_partial_and_sends_a_bad_one_on_its_own(start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, clients_per_round=4,
                               overselect=1.0, min_available=4, rounds=1)
    stub = host_stub(server)
    a = join_members(stub, "host-a", ["a0", "a1", "a2", "a3"])
    tasks = _round(server, stub, {"host-a": a}, 4)
    uploads = HostUploads(stub, pb.AgentAuth(agent_id="host-a", token=a.host_token), max_bytes=1 << 20, linger=0.5,
                          registered=lambda member: (10, 1))
    values = {"a0": 1.0, "a1": 3.0, "a2": np.inf, "a3": 5.0}  # a2's is not finite: sent on its own, and refused
    updates = {m: _update(a, m, tasks[m], np.full(SHAPE, values[m], np.float32)) for m in sorted(tasks)}
    try:
        for m in sorted(tasks):
            uploads.send_later(stub, updates[m], 10.0)
    finally:
        uploads.close()
    assert (uploads.partials_sent, uploads.refused_in_background) == (1, 1)
    assert [m for m, u in updates.items() if u.encoded] == ["a2"]  # the summed ones went from their arrays
    assert server.wait(20)  # the rejected update closes the round with the other three, as one by one
    row = next(server.coordinator.metrics.read_rows())
    assert (row["status"], row["reported"], row["rejected"], row["num_updates"]) == ("ok", 3, 1, 3.0)
    np.testing.assert_allclose(server.coordinator.weights[0], np.full(SHAPE, 3.0, np.float32))


def test_a_partial_past_the_rounds_first_k_goes_one_by_one_so_the_first_k_count(start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, clients_per_round=2,
                               overselect=1.5, min_available=3, rounds=1)
    stub = host_stub(server)
    a = join_members(stub, "host-a", ["a0", "a1", "a2"])
    tasks = _round(server, stub, {"host-a": a}, 3)  # 3 sampled, the first 2 count
    state = server.coordinator.current
    past = _send(stub, "host-a", a, _partial(tasks, ["a0", "a1", "a2"], [1, 1, 1], [10, 10, 10]))
    assert past.code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and "one by one" in past.message
    uploads = HostUploads(stub, pb.AgentAuth(agent_id="host-a", token=a.host_token), max_bytes=1 << 20, linger=0.5,
                          registered=lambda member: (10, 1))
    try:
        for m in sorted(tasks):
            uploads.send_later(stub, _update(a, m, tasks[m], np.full(SHAPE, 1.0, np.float32)), 10.0)
    finally:
        uploads.close()
    assert uploads.partials and uploads.partials_sent == 0 and uploads.refused_in_background == 0
    assert uploads.came_after_close == 1  # the late one: overselection's surplus, not a refusal to warn of
    assert server.wait(20)
    row = next(server.coordinator.metrics.read_rows())
    assert (row["status"], row["reported"]) == ("ok", 2) and state.accepted == 2


def test_a_host_sums_a_stacks_rows_straight_from_the_stack_and_encodes_only_the_one_that_goes_alone(
        start_coordinator):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], accept_populations=True, clients_per_round=4,
                               overselect=1.0, min_available=4, rounds=1)
    stub = host_stub(server)
    a = join_members(stub, "host-a", ["a0", "a1", "a2", "a3"])
    tasks = _round(server, stub, {"host-a": a}, 4)
    # members trained together: row k is ak's; row 4 is a member's whose update is not in this batch
    stack = np.arange(5 * SHAPE[0], dtype=np.float32).reshape(5, *SHAPE)
    stack[2, 3] = np.nan  # a2's is not finite: it goes on its own, and is refused
    weights = [10, 5, 7, 2]
    updates = {m: _update(a, m, tasks[m], stack[k], weights[k], StackRow(stack, (stack,), k))
               for k, m in enumerate(sorted(tasks))}
    assert all(u.rows is not None for u in updates.values())  # the runtime's arrays are the stack's rows
    assert _update(a, "a0", tasks["a0"], stack[0].copy(), 10, StackRow(stack, (stack,), 0)).rows is None  # a copy
    uploads = HostUploads(stub, pb.AgentAuth(agent_id="host-a", token=a.host_token), max_bytes=1 << 20, linger=0.5,
                          registered=lambda member: (10, 1))
    try:
        for m in reversed(sorted(tasks)):  # not in the stack's order
            uploads.send_later(stub, updates[m], 10.0)
    finally:
        uploads.close()
    assert (uploads.partials_sent, uploads.refused_in_background) == (1, 1)
    assert {m: u.encoded for m, u in updates.items()} == {"a0": False, "a1": False, "a2": True, "a3": False}
    assert server.wait(20)
    row = next(server.coordinator.metrics.read_rows())
    assert (row["status"], row["reported"], row["rejected"], row["examples"]) == ("ok", 3, 1, 17)
    kept = [0, 1, 3]
    expected = sum(weights[k] * stack[k].astype(np.float64) for k in kept) / sum(weights[k] for k in kept)
    np.testing.assert_allclose(server.coordinator.weights[0], expected.astype(np.float32), rtol=1e-6)
