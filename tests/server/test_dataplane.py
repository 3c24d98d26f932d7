"""The bulk data plane over real sockets on 127.0.0.1: bit-exact transfers, refusals that change nothing."""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
import time

import grpc
import numpy as np
import pytest
import torch
from torch import nn

from fedpar.client import dataplane
from fedpar.client.agent import Agent, AgentConfig
from fedpar.client.trainer import LocalTrainer
from fedpar.client.transfer import upload_messages
from fedpar.datasets.arrays import ArrayDataset
from fedpar.models import get_weights, weight_specs
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout, layout_to_pb
from fedpar.protocol.dataplane import (OP_DOWNLOAD, OP_UPLOAD, PREAMBLE, Deadline, encode_frame, encode_preamble,
                                       read_status, send_all)
from fedpar.server.rounds import Refusal
from support.gated_trainer import GatedTrainer

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
    agent = Agent(AgentConfig(insecure=True,
                              server=server.address, agent_id="big", poll_seconds=1.0, give_up_after=20.0),
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
    for _ in range(100):  # the refusal reaches the agent just before the coordinator records it
        if state.rejected == 1:
            break
        time.sleep(0.05)
    assert state.rejected == 1 and state.accepted == 0

    # Two good updates (c retries after its broken one) close the round; a later one is refused.
    update_a = _arrays(6)
    assert _upload(address, bots["a"], tasks["a"], update_a, examples=10).accepted
    assert _upload(address, bots["c"], tasks["c"], update_c, examples=30).accepted
    _refused(lambda: _upload(address, bots["e"], tasks["e"], _arrays(7)), grpc.StatusCode.FAILED_PRECONDITION,
             "expired")
    assert server.wait(20)
    row = server.coordinator.metrics.last
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
    assert server.coordinator.metrics.last["status"] == "failed"
    assert all(x.tobytes() == y.tobytes() for x, y in zip(server.coordinator.weights, init))


# ----------------------------------------------------------------- the gRPC path's limits apply here too
def _header(bot, task, layout, examples=10) -> pb.UploadHeader:
    return pb.UploadHeader(auth=bot.auth, round=task.round, task_id=task.task_id, num_examples=examples, steps=1,
                           tensors=layout_to_pb(layout), total_bytes=layout.total_bytes)


def _begin_upload(bot, task, layout) -> socket.socket:
    """A data-plane upload that got the go-ahead and has sent nothing yet (raises DataPlaneRefused if refused)."""
    s = socket.create_connection(("127.0.0.1", task.data_port))
    d = Deadline(10)
    try:
        send_all(s, encode_preamble(OP_UPLOAD, task.data_ticket) + encode_frame(_header(bot, task, layout)
                                                                              .SerializeToString()), d)
        read_status(s, d)
    except BaseException:
        s.close()
        raise
    return s


def _wait_pending(server, agent_id: str) -> None:
    """Until the coordinator has settled a broken-off upload (the slot is free for a retry)."""
    slot = server.coordinator.current.slots[agent_id]
    for _ in range(200):
        if slot.status == "pending":
            return
        time.sleep(0.02)
    raise AssertionError(f"the upload of {agent_id} was not settled: {slot.status}")


def _break_off(server, bot, task, layout, data: bytes = b"") -> None:
    """Start a data-plane upload, send ``data`` (less than the update), hang up, wait until it is settled."""
    with _begin_upload(bot, task, layout) as s:
        send_all(s, data, Deadline(10))
    _wait_pending(server, bot.agent_id)


def _exhausted(call, option: str) -> None:
    _refused(call, grpc.StatusCode.RESOURCE_EXHAUSTED, option)


def _grpc_exhausted(call, option: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and option in err.value.details(), \
        (err.value.code(), err.value.details())


def _unchanged(server, init) -> bool:
    return all(a.tobytes() == b.tobytes() for a, b in zip(server.coordinator.weights, init))


def test_data_plane_upload_attempts_count_with_grpc_ones(start_coordinator, agents):
    init = _arrays(0)
    server = start_coordinator(init, data_plane=True, clients_per_round=1, min_available=1,
                               max_upload_attempts_per_round=3)
    (bot,) = agents(server.address, ["tries"])
    task = bot.task()
    layout = ModelLayout.of_arrays(NAMES, init)
    msgs = list(upload_messages(bot.auth, task, layout, _arrays(1), 10, 1, {}, 4096))
    with pytest.raises(grpc.RpcError):  # attempt 1: a gRPC stream that breaks off
        bot.upload(task, None, 0, messages=msgs[:2])
    _break_off(server, bot, task, layout)  # attempts 2 and 3 on the data plane
    _break_off(server, bot, task, layout, _arrays(1)[0].tobytes()[:100])
    _exhausted(lambda: _upload(server.address, bot, task, _arrays(1)), "--max-upload-attempts")
    _grpc_exhausted(lambda: bot.upload(task, _arrays(1), 10), "--max-upload-attempts")
    state = server.coordinator.current
    assert state.accepted == 0 and state.slots["tries"].status == "pending" and _unchanged(server, init)
    assert server.data_plane.uploads == 0


def test_data_plane_upload_bytes_are_charged_to_the_agents_rate(start_coordinator, agents):
    init = _arrays(0)
    layout = ModelLayout.of_arrays(NAMES, init)  # 8320 bytes: at 1 byte/s the burst is 16640
    server = start_coordinator(init, data_plane=True, clients_per_round=1, min_available=1,
                               max_upload_bytes_per_second=1.0, max_upload_attempts_per_round=10)
    (bot,) = agents(server.address, ["fast"])
    task = bot.task()
    first = _arrays(1)[0].tobytes()  # the first tensor: 8192 bytes
    # Each upload is charged in full before its data; what did not arrive is given back when it ends.
    _break_off(server, bot, task, layout)  # charged 0
    _break_off(server, bot, task, layout, first)  # 8192
    _break_off(server, bot, task, layout, first)  # 8192: 256 bytes are left
    _exhausted(lambda: _upload(server.address, bot, task, _arrays(1)), "--max-upload-bytes-per-second")
    _grpc_exhausted(lambda: bot.upload(task, _arrays(1), 10), "--max-upload-bytes-per-second")  # the same bucket
    state = server.coordinator.current
    assert state.accepted == 0 and state.slots["fast"].status == "pending" and _unchanged(server, init)


def test_data_plane_uploads_count_as_calls_of_their_agent(start_coordinator, agents):
    init = _arrays(0)
    server = start_coordinator(init, data_plane=True, clients_per_round=1, min_available=1, max_calls_per_agent=1)
    (bot,) = agents(server.address, ["busy"])
    task = bot.task()
    layout = ModelLayout.of_arrays(NAMES, init)
    with _begin_upload(bot, task, layout):  # the data-plane upload in progress is the agent's one call
        _grpc_exhausted(lambda: bot.stub.Heartbeat(pb.HeartbeatRequest(auth=bot.auth), timeout=5),
                   "--max-calls-per-agent")
    _wait_pending(server, "busy")
    assert bot.stub.Heartbeat(pb.HeartbeatRequest(auth=bot.auth), timeout=5).current_round == 1

    msgs = list(upload_messages(bot.auth, task, layout, _arrays(1), 10, 1, {}, 4096))
    release = threading.Event()

    def held_open():
        yield msgs[0]
        release.wait(20)

    held = bot.stub.UploadUpdate.future(held_open(), timeout=30)  # a gRPC upload in progress: the one call
    try:
        for _ in range(100):
            if server.coordinator.current.slots["busy"].status == "uploading":
                break
            time.sleep(0.05)
        _exhausted(lambda: _upload(server.address, bot, task, _arrays(1)), "--max-calls-per-agent")
    finally:
        release.set()
        with pytest.raises(grpc.RpcError):
            held.result()
    _wait_pending(server, "busy")
    assert _unchanged(server, init)
    update = _arrays(2)
    assert _upload(server.address, bot, task, update).accepted  # every call ended: the limit is free again
    assert server.wait(20)
    for got, sent in zip(server.coordinator.weights, update):
        np.testing.assert_allclose(got, sent, rtol=1e-6)


def test_data_plane_uploads_hold_places_in_the_upload_queue(start_coordinator, agents):
    init = _arrays(0)
    server = start_coordinator(init, data_plane=True, clients_per_round=2, min_available=2,
                               max_concurrent_uploads=1, max_queued_uploads=1)
    a, b = agents(server.address, ["a", "b"])
    tasks = {bot.agent_id: bot.task() for bot in (a, b)}
    layout = ModelLayout.of_arrays(NAMES, init)
    update_a, update_b = _arrays(1), _arrays(2)
    with _begin_upload(a, tasks["a"], layout) as held:  # a holds the only place
        _exhausted(lambda: _upload(server.address, b, tasks["b"], update_b, examples=30), "--max-queued-uploads")
        _grpc_exhausted(lambda: b.upload(tasks["b"], update_b, 30), "--max-queued-uploads")  # one queue for both paths
        assert _unchanged(server, init) and server.coordinator.current.slots["b"].status == "pending"
        send_all(held, b"".join(x.tobytes() for x in update_a), Deadline(10))
        assert pb.UploadReply.FromString(read_status(held, Deadline(10))).accepted
    # a's place is given back on the coordinator's loop just after its reply: b may hear 'busy' once more, as an
    # agent would, and retry
    end = time.monotonic() + 10
    while True:
        try:
            assert _upload(server.address, b, tasks["b"], update_b, examples=30).accepted
            break
        except dataplane.DataPlaneRefused as err:
            assert "--max-queued-uploads" in err.message and time.monotonic() < end, err.message
            time.sleep(0.05)
    assert server.wait(20)
    for got, x, y in zip(server.coordinator.weights, update_a, update_b):
        np.testing.assert_allclose(got, (10 * x + 30 * y) / 40, rtol=1e-6, atol=1e-7)


def test_a_real_agent_retries_a_data_plane_upload_while_the_queue_is_full(start_coordinator, agents):
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    init = [w.detach().numpy().copy() for w in model.parameters()]
    names = [n for n, _, _ in weight_specs(model)]
    server = start_coordinator(init, names=names, data_plane=True, clients_per_round=2, min_available=2,
                               max_concurrent_uploads=1, max_queued_uploads=1)
    (holder,) = agents(server.address, ["holder"])
    rng = np.random.default_rng(1)
    gate = threading.Event()
    trainer = GatedTrainer(model, ArrayDataset(rng.standard_normal((32, 16)).astype(np.float32),
                                                rng.integers(0, 4, 32)), gate=gate)
    agent = Agent(AgentConfig(insecure=True,
                              server=server.address, agent_id="eager", poll_seconds=1.0, give_up_after=20.0), trainer)
    runner = threading.Thread(target=agent.run)
    runner.start()
    task = holder.task()
    layout = ModelLayout.of_arrays(names, init)
    intake, refusals = server.data_plane.intake, []
    queue = intake.upload_queue

    @contextlib.contextmanager
    def counted_queue():
        try:
            with queue():
                yield
        except Refusal as r:
            refusals.append(r.message)
            raise
    intake.upload_queue = counted_queue
    with _begin_upload(holder, task, layout) as held:
        gate.set()
        for _ in range(200):  # the agent is refused (the queue is full) and tries again
            if len(refusals) >= 2:
                break
            time.sleep(0.05)
        assert len(refusals) >= 2 and "--max-queued-uploads" in refusals[0] and agent.stats.accepted == 0
        send_all(held, b"".join(w.tobytes() for w in init), Deadline(10))
        assert pb.UploadReply.FromString(read_status(held, Deadline(10))).accepted
    runner.join(30)
    assert not runner.is_alive() and server.wait(10)
    assert (agent.stats.accepted, agent.stats.refused) == (1, 0), agent.stats.refusals
    assert server.data_plane.uploads == 2


def test_data_plane_downloads_count_as_calls_of_their_agent(start_coordinator, agents):
    init = [np.random.default_rng(0).standard_normal(10_000_000).astype(np.float32)]  # 40 MB: outlasts socket buffers
    server = start_coordinator(init, names=["w"], data_plane=True, clients_per_round=1, min_available=1,
                               max_calls_per_agent=1)
    (bot,) = agents(server.address, ["reader"])
    task = bot.task()
    sock = dataplane.DataPlaneTarget(server.address, task).connect(OP_DOWNLOAD, Deadline(10))
    try:  # once the download is under way (its reader is not reading), it is the agent's one call
        for _ in range(100):
            try:
                bot.stub.Heartbeat(pb.HeartbeatRequest(auth=bot.auth), timeout=5)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
                assert "--max-calls-per-agent" in err.details()
                break
            time.sleep(0.05)
        else:
            raise AssertionError("a call beside the data-plane download was never refused")
    finally:
        sock.close()
    for _ in range(100):  # the broken-off download gave its call back
        try:
            assert bot.stub.Heartbeat(pb.HeartbeatRequest(auth=bot.auth), timeout=5).current_round == 1
            break
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            time.sleep(0.05)
    else:
        raise AssertionError("the call of the broken-off download was never released")


def test_a_task_handed_out_again_keeps_its_data_plane_ticket(start_coordinator, agents):
    init = _arrays(0)
    server = start_coordinator(init, data_plane=True, clients_per_round=1, min_available=1)
    (bot,) = agents(server.address, ["again"])
    first, again = bot.task(), bot.task()  # no download completed in between: the same task again
    assert first.task_id == again.task_id and first.data_ticket and first.data_ticket == again.data_ticket
    assert _upload(server.address, bot, again, _arrays(1)).accepted  # the one ticket still works
