"""The bulk data plane over real sockets on 127.0.0.1: bit-exact transfers, refusals that change nothing."""

from __future__ import annotations

import secrets
import socket
import time

import grpc
import numpy as np
import pytest
import torch
from torch import nn

from fedpar.client import dataplane
from fedpar.client.agent import Agent, AgentConfig
from fedpar.client.trainer import LocalTrainer
from fedpar.datasets.arrays import ArrayDataset
from fedpar.models import get_weights, weight_specs
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout
from fedpar.protocol.dataplane import (OP_UPLOAD, PREAMBLE, Deadline, encode_frame, encode_preamble, read_status,
                                       send_all)
from fedpar.protocol.messages import layout_to_pb

SHAPES = ((64, 32), (32,))
NAMES = ["t0", "t1"]


def _arrays(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def _target(address: str, task: pb.TrainTask, ticket: bytes | None = None) -> dataplane.DataPlaneTarget:
    target = dataplane.DataPlaneTarget(address, task)
    if ticket is not None:
        target.ticket = ticket
    return target


def _refused(call, code: grpc.StatusCode, *fragments: str) -> None:
    with pytest.raises(dataplane.DataPlaneRefused) as err:
        call()
    assert err.value.code == code.value[0], dataplane.refusal_text(err.value)
    for fragment in fragments:
        assert fragment in err.value.message, err.value.message


def _upload(address, bot, task, arrays, ticket=None, examples=10, layout=None):
    layout = layout or ModelLayout.of_arrays(NAMES, arrays)
    return dataplane.upload(_target(address, task, ticket), bot.auth, task, layout, arrays, examples, 1, {}, 20.0)


class _BigModel(nn.Module):
    """A small classifier plus 25M float32 weights that training never touches (they must survive bit-exact)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 4)
        self.bulk = nn.Parameter(torch.zeros(25_000_000 - 16 * 4 - 4))

    def forward(self, x):
        return self.head(x)


def test_100mb_model_round_trips_bit_exact_through_a_real_agent(start_coordinator):
    torch.manual_seed(0)
    model = _BigModel()
    rng = np.random.default_rng(1)
    specs = weight_specs(model)
    init = [rng.standard_normal(shape, dtype=np.float32) for _, _, shape in specs]
    assert sum(a.nbytes for a in init) == 100_000_000
    server = start_coordinator(init, names=[n for n, _, _ in specs], clients_per_round=1,
                               min_available=1, deadline_seconds=60)
    assert server.coordinator.data_port  # on by default for a model this large
    data = ArrayDataset(rng.standard_normal((32, 16)).astype(np.float32), rng.integers(0, 4, 32))
    agent = Agent(AgentConfig(server=server.address, agent_id="big", poll_seconds=1.0, give_up_after=20.0),
                  LocalTrainer(model, data))
    stats = agent.run()
    assert stats.accepted == 1 and stats.refused == 0, stats.refusals
    assert server.wait(30)
    plane = server.data_plane
    assert (plane.downloads, plane.uploads) == (1, 1)
    final = get_weights(model)
    bulk = [n for n, _, _ in specs].index("bulk")
    assert final[bulk].tobytes() == init[bulk].tobytes()  # downloaded bit-exact (training leaves it alone)
    assert any(f.tobytes() != i.tobytes() for f, i in zip(final, init))  # the head did train
    for got, sent in zip(server.coordinator.weights, final):  # uploaded exactly: FedAvg of one update is
        assert np.array_equal(got, sent)  # that update (up to the sign of zeros: 0.0 + -0.0 = 0.0)


def test_bad_tickets_and_bad_uploads_are_refused_and_only_valid_updates_count(start_coordinator, agents):
    init = _arrays(0)
    ids = ["a", "b", "c", "d", "e"]
    server = start_coordinator(init, data_plane=True, clients_per_round=2, overselect=2.5, min_available=5,
                               deadline_seconds=30)
    address = server.address
    bots = dict(zip(ids, agents(address, ids)))
    tasks = {i: bots[i].task() for i in ids}
    assert all(t.data_port == server.coordinator.data_port and len(t.data_ticket) == 32 for t in tasks.values())
    layout = ModelLayout.of_arrays(NAMES, init)

    # A ticket nobody issued; a ticket used twice; another agent's ticket.
    _refused(lambda: dataplane.download(_target(address, tasks["a"], secrets.token_bytes(32)), layout, 10),
             grpc.StatusCode.PERMISSION_DENIED, "unknown data-plane ticket")
    got = dataplane.download(_target(address, tasks["a"]), layout, 10)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(got, init))
    _refused(lambda: dataplane.download(_target(address, tasks["a"]), layout, 10),
             grpc.StatusCode.ALREADY_EXISTS, "already used for the download")
    _refused(lambda: _upload(address, bots["a"], tasks["a"], _arrays(1), ticket=tasks["b"].data_ticket),
             grpc.StatusCode.PERMISSION_DENIED, "issued to agent 'b'")

    # total_bytes that does not match the tensors; an absurd header length (refused before allocating).
    header = pb.UploadHeader(auth=bots["b"].auth, round=tasks["b"].round, task_id=tasks["b"].task_id,
                             num_examples=10, steps=1, tensors=layout_to_pb(layout), total_bytes=layout.total_bytes + 4)
    with socket.create_connection(("127.0.0.1", tasks["b"].data_port)) as s:
        d = Deadline(10)
        send_all(s, encode_preamble(OP_UPLOAD, tasks["b"].data_ticket) + encode_frame(header.SerializeToString()), d)
        _refused(lambda: read_status(s, d), grpc.StatusCode.INVALID_ARGUMENT, "total_bytes=")
    with socket.create_connection(("127.0.0.1", tasks["b"].data_port)) as s:
        d = Deadline(10)
        send_all(s, encode_preamble(OP_UPLOAD, tasks["b"].data_ticket) + b"\xff\xff\xff\xff", d)
        _refused(lambda: read_status(s, d), grpc.StatusCode.INVALID_ARGUMENT, "exceeds the limit")

    # A truncated upload is abandoned (nothing applied) and the agent may try again this round.
    update_c = _arrays(3)
    header = pb.UploadHeader(auth=bots["c"].auth, round=tasks["c"].round, task_id=tasks["c"].task_id,
                             num_examples=30, steps=1, tensors=layout_to_pb(layout), total_bytes=layout.total_bytes)
    with socket.create_connection(("127.0.0.1", tasks["c"].data_port)) as s:
        d = Deadline(10)
        send_all(s, encode_preamble(OP_UPLOAD, tasks["c"].data_ticket) + encode_frame(header.SerializeToString()), d)
        read_status(s, d)
        send_all(s, update_c[0].tobytes()[:1000], d)
    state = server.coordinator.current
    for _ in range(100):
        if state.slots["c"].status == "pending":
            break
        time.sleep(0.05)
    assert state.slots["c"].status == "pending" and state.accepted == 0

    # NaN in the data: refused after the scan, the slot is spent.
    nan = _arrays(4)
    nan[1][5] = np.nan
    _refused(lambda: _upload(address, bots["d"], tasks["d"], nan), grpc.StatusCode.INVALID_ARGUMENT, "NaN or Inf")
    _refused(lambda: _upload(address, bots["d"], tasks["d"], _arrays(5)), grpc.StatusCode.ALREADY_EXISTS)
    assert state.rejected == 1 and state.accepted == 0

    # Two good updates (c retries after its broken one) close the round; a later one is refused.
    update_a = _arrays(6)
    assert _upload(address, bots["a"], tasks["a"], update_a, examples=10).accepted
    assert _upload(address, bots["c"], tasks["c"], update_c, examples=30).accepted
    _refused(lambda: _upload(address, bots["e"], tasks["e"], _arrays(7)), grpc.StatusCode.FAILED_PRECONDITION,
             "expired")
    assert server.wait(20)
    row = server.coordinator.metrics.rows[-1]
    assert (row["reported"], row["rejected"]) == (2, 1)
    for got, x, y in zip(server.coordinator.weights, update_a, update_c):
        np.testing.assert_allclose(got, (10 * x + 30 * y) / 40, rtol=1e-6, atol=1e-7)


def test_agent_that_ignores_the_data_plane_still_completes_a_round_over_grpc(start_coordinator, agents):
    init = _arrays(0)
    server = start_coordinator(init, data_plane=True, clients_per_round=1, min_available=1)
    (bot,) = agents(server.address, ["old"])
    task = bot.task()
    assert task.data_port and task.data_ticket  # offered, and ignored: old agents use the streams
    got = bot.download(task, ModelLayout.of_arrays(NAMES, init))
    assert all(x.tobytes() == y.tobytes() for x, y in zip(got, init))
    update = _arrays(9)
    assert bot.upload(task, update, 10).accepted
    assert server.wait(20)
    assert (server.data_plane.downloads, server.data_plane.uploads) == (0, 0)
    for got, sent in zip(server.coordinator.weights, update):
        np.testing.assert_allclose(got, sent, rtol=1e-6)


def test_small_models_keep_to_grpc_by_default(start_coordinator, agents):
    server = start_coordinator(_arrays(0), clients_per_round=1, min_available=1)
    (bot,) = agents(server.address, ["small"])
    task = bot.task()
    assert server.data_plane is None and not task.data_port and not task.data_ticket
    assert bot.upload(task, _arrays(1), 10).accepted
    assert server.wait(20)


def test_preamble_that_is_not_ours_is_dropped(start_coordinator):
    server = start_coordinator(_arrays(0), data_plane=True, clients_per_round=1, min_available=1)
    with socket.create_connection(("127.0.0.1", server.coordinator.data_port)) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(PREAMBLE.size))
        s.settimeout(10)
        try:
            assert s.recv(100) == b""  # closed without an answer
        except ConnectionResetError:
            pass  # (or reset: it left our unread bytes behind)


def test_upload_that_stalls_past_the_round_deadline_is_dropped_and_changes_nothing(start_coordinator, agents):
    init = _arrays(0)
    server = start_coordinator(init, data_plane=True, clients_per_round=1, min_available=1, deadline_seconds=1.5)
    (bot,) = agents(server.address, ["slow"])
    task = bot.task()
    layout = ModelLayout.of_arrays(NAMES, init)
    header = pb.UploadHeader(auth=bot.auth, round=task.round, task_id=task.task_id, num_examples=10, steps=1,
                             tensors=layout_to_pb(layout), total_bytes=layout.total_bytes)
    with socket.create_connection(("127.0.0.1", task.data_port)) as s:
        d = Deadline(10)
        send_all(s, encode_preamble(OP_UPLOAD, task.data_ticket) + encode_frame(header.SerializeToString()), d)
        read_status(s, d)
        send_all(s, _arrays(1)[0].tobytes()[:100], d)  # ... and then nothing more
        s.settimeout(10)
        started = time.monotonic()
        try:
            assert s.recv(100) == b""
        except ConnectionResetError:
            pass
        assert time.monotonic() - started < 5  # dropped at the round deadline, not at our timeout
    assert server.wait(10)
    assert server.coordinator.metrics.rows[-1]["status"] == "failed"
    assert all(x.tobytes() == y.tobytes() for x, y in zip(server.coordinator.weights, init))
