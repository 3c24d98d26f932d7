"""Small models over real gRPC: weights inside the task, the update in one UploadSmall call, and their checks."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from fedpar.client.transfer import small_upload, task_weights, upload_header
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in ((8, 5), (5,))]


NAMES = ["t0", "t1"]


def _small(bot, task, arrays, n=10, layout=None):
    layout = layout or ModelLayout.of_arrays(NAMES, arrays)
    header = upload_header(bot.auth, task, layout, n, 1, {"train_loss": 0.5})
    message = small_upload(header, layout, arrays, bot.max_chunk)
    assert message is not None
    return message


def test_small_model_comes_inside_the_task_and_its_update_goes_in_one_call(start_coordinator, agents):
    init = _weights()
    server = start_coordinator(init, NAMES, clients_per_round=2, min_available=2)
    a, b = agents(server.address, ["a", "b"])
    layout = ModelLayout.of_arrays(NAMES, init)
    updates, counts = [_weights(1), _weights(2)], [30, 10]
    for bot, update, n in zip((a, b), updates, counts):
        task = bot.task()
        assert task.HasField("weights_header") and len(task.weights) == layout.total_bytes
        got = task_weights(task, layout)
        assert all(x.tobytes() == y.tobytes() for x, y in zip(got, init))
        assert bot.stub.UploadSmall(_small(bot, task, update, n), timeout=10).accepted
    assert server.wait(30)
    row = server.coordinator.metrics.last
    assert (row["status"], row["reported"]) == ("ok", 2)
    for new, u1, u2 in zip(server.coordinator.weights, *updates):
        np.testing.assert_allclose(new, (30 * u1.astype(np.float64) + 10 * u2) / 40, rtol=1e-6, atol=1e-7)


def test_a_model_above_the_inline_limit_is_downloaded(start_coordinator, agents):
    init = _weights()
    server = start_coordinator(init, NAMES, clients_per_round=1, min_available=1, inline_weights_max_bytes=64)
    (bot,) = agents(server.address, ["a"])
    task = bot.task()
    assert not task.HasField("weights_header") and not task.weights
    assert task_weights(task, ModelLayout.of_arrays(NAMES, init)) is None
    got = bot.download(task, ModelLayout.of_arrays(NAMES, init))
    assert all(x.tobytes() == y.tobytes() for x, y in zip(got, init))


def test_an_inline_task_is_handed_out_again_until_the_agent_says_it_finished_with_it(start_coordinator, agents):
    init = _weights()
    server = start_coordinator(init, NAMES, clients_per_round=1, min_available=1, heartbeat_seconds=0.3)
    (bot,) = agents(server.address, ["a"])
    first = bot.task()  # the reply "was lost": pulling again returns the same task
    again = bot.task()
    assert (again.round, again.task_id, again.weights) == (first.round, first.task_id, first.weights)
    done = bot.stub.PullTask(pb.PullTaskRequest(auth=bot.auth, wait_seconds=0.3, finished_task_id=first.task_id),
                             timeout=10)
    assert done.WhichOneof("kind") == "wait_seconds"  # finished (e.g. dropped out): never repeated
    assert bot.stub.UploadSmall(_small(bot, first, _weights(1)), timeout=10).accepted


def test_an_agent_that_says_it_finished_a_streamed_task_is_not_handed_it_again(start_coordinator, agents):
    init = _weights()
    server = start_coordinator(init, NAMES, clients_per_round=1, min_available=1, inline_weights_max_bytes=0,
                               heartbeat_seconds=0.3)
    (bot,) = agents(server.address, ["a"])
    task = bot.task()
    reply = bot.stub.PullTask(pb.PullTaskRequest(auth=bot.auth, wait_seconds=0.3, finished_task_id=task.task_id),
                              timeout=10)
    assert reply.WhichOneof("kind") == "wait_seconds"


@pytest.mark.parametrize("defect", ["short_data", "long_data", "nan", "inf", "no_header", "wrong_round",
                                    "wrong_shape", "unknown_agent", "too_large"])
def test_bad_small_uploads_are_refused_and_change_nothing(start_coordinator, agents, defect):
    init = _weights()
    server = start_coordinator(init, NAMES, clients_per_round=2, min_available=2, max_chunk_bytes=4096)
    bot, _ = agents(server.address, ["a", "b"])  # b keeps the round open after a's refusal
    task = bot.task()
    message = _small(bot, task, _weights(1))
    expected = grpc.StatusCode.INVALID_ARGUMENT
    if defect == "short_data":
        message.data = message.data[:-4]
    elif defect == "long_data":
        message.data += b"\0\0\0\0"
    elif defect in ("nan", "inf"):
        bad = _weights(1)
        bad[0][3, 2] = np.nan if defect == "nan" else -np.inf
        message.data = b"".join(a.tobytes() for a in bad)
    elif defect == "no_header":
        message.ClearField("header")
    elif defect == "wrong_round":
        message.header.round = 7
        expected = grpc.StatusCode.FAILED_PRECONDITION
    elif defect == "wrong_shape":
        message.header.tensors[0].shape[:] = [5, 8]
    elif defect == "unknown_agent":
        message.header.auth.token = "forged"
        expected = grpc.StatusCode.UNAUTHENTICATED
    elif defect == "too_large":  # one tensor of 8 KiB: more than one 4 KiB chunk, so it must be streamed
        message.header.tensors[0].shape[:] = [2048]
        message.header.tensors[1].shape[:] = [0]
        message.header.total_bytes = 8192
        message.data = np.ones(2048, np.float32).tobytes()
    with pytest.raises(grpc.RpcError) as err:
        bot.stub.UploadSmall(message, timeout=10)
    assert err.value.code() == expected, err.value.details()
    assert err.value.details()
    assert server.coordinator.current.accepted == 0
    assert all(x.tobytes() == y.tobytes() for x, y in zip(server.coordinator.weights, init))
    if defect in ("short_data", "long_data", "nan", "inf"):  # content refused: a second try is a duplicate
        with pytest.raises(grpc.RpcError) as again:
            bot.stub.UploadSmall(_small(bot, task, _weights(1)), timeout=10)
        assert again.value.code() == grpc.StatusCode.ALREADY_EXISTS


def test_a_duplicate_small_upload_is_refused(start_coordinator, agents):
    init = _weights()
    server = start_coordinator(init, NAMES, clients_per_round=2, min_available=2)
    a, _ = agents(server.address, ["a", "b"])
    task = a.task()
    assert a.stub.UploadSmall(_small(a, task, _weights(1)), timeout=10).accepted
    with pytest.raises(grpc.RpcError) as err:
        a.stub.UploadSmall(_small(a, task, _weights(2)), timeout=10)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS


def test_small_upload_helper_leaves_big_updates_to_the_stream():
    layout = ModelLayout.of_arrays(["w"], [np.zeros(100_000, np.float32)])
    header = pb.UploadHeader(total_bytes=layout.total_bytes)
    assert small_upload(header, layout, [np.zeros(100_000, np.float32)], 1 << 20) is None  # >= 256 KiB
    assert small_upload(header, layout, [np.zeros(100_000, np.float32)], 64 << 10) is None  # > one chunk


def test_a_real_agent_that_drops_out_trains_once_per_round_and_finishes(start_coordinator):
    import threading

    import torch
    from torch import nn

    from fedpar.client.agent import Agent, AgentConfig
    from fedpar.client.trainer import LocalTrainer
    from fedpar.datasets import ArrayDataset
    from fedpar.models import get_weights, weight_specs

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    rng = np.random.default_rng(0)
    trainer = LocalTrainer(model, ArrayDataset(rng.standard_normal((16, 4)).astype(np.float32), rng.integers(0, 3, 16)))
    init = get_weights(model)
    server = start_coordinator(init, names=[n for n, _, _ in weight_specs(model)], rounds=2, clients_per_round=1,
                               min_available=1, deadline_seconds=2.0, heartbeat_seconds=0.3)
    # Always vanishes after training: it tells the coordinator it finished, so the task (weights inside) is
    # not handed to it again in the same round.
    agent = Agent(AgentConfig(insecure=True,
                              server=server.address, agent_id="flaky", poll_seconds=0.3, drop_probability=1.0,
                              give_up_after=30, seed=0), trainer)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    assert server.wait(60)
    thread.join(30)
    assert not thread.is_alive()
    assert (agent.stats.tasks, agent.stats.dropped) == (2, 2)
    assert [row["status"] for row in server.coordinator.metrics.read_rows()] == ["failed", "failed"]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(server.coordinator.weights, init))
