"""Hostile peers on both ends of the bulk data plane, over real sockets on 127.0.0.1."""

from __future__ import annotations

import errno
import logging
import socket
import struct
import threading
import time

import grpc
import numpy as np
import pytest

from fedpar.client import dataplane
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import CodecError, ModelLayout, layout_to_pb
from fedpar.protocol.dataplane import (OP_DOWNLOAD, OP_UPLOAD, PREAMBLE, DataPlaneError, Deadline, encode_frame,
                                       encode_preamble, encode_status, read_status)

SHAPES = ((1024, 1024),)  # 4 MB: more than the socket buffers hold, so an unread download blocks its sender
NAMES = ["t0"]


def _arrays(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def test_downloads_that_are_never_read_do_not_hold_back_honest_ones(start_coordinator, agents):
    # Three sampled agents open their downloads and never read them: with two transfer threads, the honest
    # download used to wait in the queue until its own deadline.
    init = _arrays(0)
    ids = ["h0", "h1", "h2", "ok"]
    server = start_coordinator(init, names=NAMES, data_plane=True, clients_per_round=4, min_available=4,
                               deadline_seconds=60, data_plane_downloads=1, max_concurrent_uploads=1,
                               upload_idle_seconds=1.0)
    bots = dict(zip(ids, agents(server.address, ids)))
    tasks = {i: bots[i].task() for i in ids}
    hogs = []
    for i in ids[:3]:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", tasks[i].data_port))
        s.sendall(encode_preamble(OP_DOWNLOAD, tasks[i].data_ticket))
        hogs.append(s)
    time.sleep(0.5)
    start = time.monotonic()
    got = dataplane.download(dataplane.DataPlaneTarget(server.address, tasks["ok"]),
                             ModelLayout.of_arrays(NAMES, init), 20)
    assert got[0].tobytes() == init[0].tobytes()
    assert time.monotonic() - start < 10  # the readers that stopped were dropped, not served until the deadline
    for s in hogs:
        s.close()
    plane = server.data_plane
    end = time.monotonic() + 10
    while (plane.busy or plane.limits._calls) and time.monotonic() < end:
        time.sleep(0.05)
    assert plane.downloads == 1 and not plane.busy and not plane.limits._calls
    assert not [e for e in server.coordinator.tickets._live.values() if "used" in e.ops.values() and e.agent_id != "ok"]


class _OutOfDescriptors:
    """A listener whose accept fails at once, as a real one does while the process has no file descriptor left."""

    def __init__(self, real: socket.socket):
        self.real, self.calls = real, 0

    def accept(self):
        self.calls += 1
        raise OSError(errno.EMFILE, "Too many open files")

    def close(self) -> None:
        self.real.close()


def test_accept_failing_at_once_does_not_spin_a_core(start_coordinator, agents, caplog):
    init = _arrays(0)
    server = start_coordinator(init, names=NAMES, data_plane=True, clients_per_round=1, min_available=1)
    plane = server.data_plane
    (bot,) = agents(server.address, ["a"])
    task = bot.task()
    real = plane._listener
    plane._listener = failing = _OutOfDescriptors(real)
    time.sleep(1.0)
    plane._listener = real
    assert 1 <= failing.calls <= 20, failing.calls  # it used to retry as fast as the core allowed
    got = dataplane.download(dataplane.DataPlaneTarget(server.address, task), ModelLayout.of_arrays(NAMES, init), 10)
    assert got[0].tobytes() == init[0].tobytes()
    said = [r.getMessage() for r in caplog.records if r.name == "fedpar.server.dataplane" and r.levelname == "WARNING"]
    assert said == ["data plane cannot accept connections: [Errno 24] Too many open files; retrying every 0.1 s",
                    "data plane accepts connections again"], said



@pytest.mark.parametrize("host, port", [("a" * 300, 5555), ("a..b", 5555), ("evil\nINFO forged line", 5555),
                                        ("127.0.0.1", 70000), ("127.0.0.1", 0xFFFFFFFF)])
def test_a_task_naming_an_impossible_data_plane_is_a_data_plane_error(host, port):
    # A coordinator's task names the data plane's host and port: a host idna cannot encode raised UnicodeError past
    # the agent's fallback to gRPC (the agent exited), and port 70000 dialed port 4464.
    task = pb.TrainTask(round=1, task_id="t", data_port=port, data_ticket=b"k" * 32)
    target = dataplane.DataPlaneTarget(f"{host}:1", task)
    layout = ModelLayout.of_arrays(NAMES, _arrays(0))
    with pytest.raises(dataplane.DataPlaneError) as err:
        dataplane.download(target, layout, 2.0)
    assert "\n" not in str(err.value), err.value


def _refused(call, code: grpc.StatusCode, fragment: str) -> None:
    with pytest.raises(dataplane.DataPlaneRefused) as err:
        call()
    assert err.value.code == code.value[0] and fragment in err.value.message, dataplane.refusal_text(err.value)


def test_tickets_of_earlier_rounds_move_nothing(start_coordinator, agents):
    small = [np.arange(8, dtype=np.float32)]
    server = start_coordinator(small, data_plane=True, rounds=3, clients_per_round=2, min_available=2,
                               deadline_seconds=30)
    a, b = agents(server.address, ["a", "b"])
    layout = ModelLayout.of_arrays(["t0"], small)
    old = {}
    for round_id in (1, 2):
        for bot in (a, b):
            task = bot.task()
            assert task.round == round_id
            old.setdefault(round_id, {})[bot.agent_id] = task
            if bot is a:  # a downloads over the data plane, then uploads over gRPC
                dataplane.download(dataplane.DataPlaneTarget(server.address, task), layout, 10)
            assert bot.upload(task, [np.full(8, round_id, np.float32)], 10).accepted
    now = a.task()
    assert now.round == 3
    for past, code, fragment in ((2, grpc.StatusCode.FAILED_PRECONDITION, "of round 2 has expired"),
                                 (1, grpc.StatusCode.PERMISSION_DENIED, "unknown data-plane ticket")):
        task = old[past]["a"]
        target = dataplane.DataPlaneTarget(server.address, task)
        _refused(lambda: dataplane.download(target, layout, 10), code, fragment)
        _refused(lambda: dataplane.upload(target, a.auth, task, layout, [np.zeros(8, np.float32)], 10, 1, {}, 10),
                 code, fragment)
        # the old ticket with this round's task in the header: the ticket decides, and it is dead
        _refused(lambda: dataplane.upload(target, a.auth, now, layout, [np.zeros(8, np.float32)], 10, 1, {}, 10),
                 code, fragment)
    state = server.coordinator.current
    assert state.round_id == 3 and state.accepted == 0 and state.rejected == 0
    assert np.array_equal(server.coordinator.weights[0], np.full(8, 2, np.float32))
    assert dataplane.upload(dataplane.DataPlaneTarget(server.address, now), a.auth, now, layout,
                            [np.full(8, 3, np.float32)], 10, 1, {}, 10).accepted


def _stand_in(behave) -> int:
    """A one-connection data plane on 127.0.0.1 that reads the preamble, then does ``behave(conn)``; its port."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run():
        with listener:
            conn, _ = listener.accept()
            with conn:
                try:
                    conn.recv(PREAMBLE.size)
                    behave(conn)
                    time.sleep(0.5)
                except OSError:
                    pass
    threading.Thread(target=run, daemon=True).start()
    return listener.getsockname()[1]


ARRAYS = [np.arange(12, dtype=np.float32).reshape(4, 3), np.ones(5, np.float32)]
LAYOUT = ModelLayout.of_arrays(["a", "b"], ARRAYS)
HEADER = pb.ModelHeader(tensors=layout_to_pb(LAYOUT), total_bytes=LAYOUT.total_bytes).SerializeToString()
DATA = b"".join(a.tobytes() for a in ARRAYS)


@pytest.mark.parametrize("behave, error, fragment", [
    (lambda c: c.sendall(b"\0\0\0garbage" * 50), DataPlaneError, "exceeds the limit"),
    (lambda c: c.sendall(encode_status(0, b"\xff\xff\xff")), DataPlaneError, "malformed ModelHeader"),
    (lambda c: (c.sendall(encode_status(0, HEADER) + DATA[:9]), time.sleep(5)), DataPlaneError, "stalled"),
    (lambda c: c.sendall(encode_status(0, HEADER) + DATA[:9]), DataPlaneError, "connection closed after 9 of"),
    (lambda c: c.sendall(encode_status(0, pb.ModelHeader(tensors=layout_to_pb(LAYOUT), total_bytes=1 << 62)
                                       .SerializeToString())), CodecError, "total_bytes=4611686018427387904"),
    (lambda c: c.sendall(encode_status(0, pb.ModelHeader(tensors=layout_to_pb(ModelLayout.of_arrays(
        ["a", "b"], ARRAYS[::-1])), total_bytes=LAYOUT.total_bytes).SerializeToString()) + DATA), CodecError,
     "does not fit this agent's task"),
    (lambda c: c.sendall(encode_status(0, HEADER) + np.full(17, np.nan, np.float32).tobytes()), CodecError,
     "NaN or Inf"),
    (lambda c: c.sendall(encode_status(250, "no\x1b[2J\nway".encode())), dataplane.DataPlaneRefused, "no"),
], ids=["garbage", "bad-header", "stall", "cut", "huge-total", "other-model", "nan", "odd-refusal"])
def test_the_agent_refuses_what_a_hostile_data_plane_sends_by_its_deadline(behave, error, fragment):
    task = pb.TrainTask(round=1, task_id="t", data_port=_stand_in(behave), data_ticket=b"k" * 32)
    start = time.monotonic()
    with pytest.raises(error) as err:
        dataplane.download(dataplane.DataPlaneTarget("127.0.0.1:1", task), LAYOUT, 2.0)
    assert fragment in str(err.value) and time.monotonic() - start < 3.5, err.value
    if error is dataplane.DataPlaneRefused:
        assert dataplane.refusal_text(err.value).startswith("250: no"), err.value


def test_a_reply_longer_than_the_model_gives_the_model_exactly():
    task = pb.TrainTask(round=1, task_id="t", data_port=_stand_in(
        lambda c: c.sendall(encode_status(0, HEADER) + DATA + b"trailing" * 1000)), data_ticket=b"k" * 32)
    got = dataplane.download(dataplane.DataPlaneTarget("127.0.0.1:1", task), LAYOUT, 2.0)
    assert [g.tobytes() for g in got] == [a.tobytes() for a in ARRAYS]


@pytest.mark.parametrize("behave, error, fragment", [
    (lambda c: (c.recv(1 << 16), time.sleep(5)), DataPlaneError, "stalled"),
    (lambda c: (c.recv(1 << 16), c.sendall(b"zzzzzzzzzzzz")), DataPlaneError, "exceeds the limit"),
    (lambda c: (c.recv(1 << 16), c.sendall(encode_status(0)), c.recv(1 << 16), c.sendall(encode_status(0, b"\xff"))),
     DataPlaneError, "malformed UploadReply"),
], ids=["stall", "garbage", "bad-reply"])
def test_the_agent_gives_up_an_upload_to_a_hostile_data_plane_by_its_deadline(behave, error, fragment):
    task = pb.TrainTask(round=1, task_id="t", data_port=_stand_in(behave), data_ticket=b"k" * 32)
    start = time.monotonic()
    with pytest.raises(error) as err:
        dataplane.upload(dataplane.DataPlaneTarget("127.0.0.1:1", task), pb.AgentAuth(agent_id="a", token="t"), task,
                         LAYOUT, ARRAYS, 1, 1, {}, 2.0)
    assert fragment in str(err.value) and time.monotonic() - start < 3.5, err.value


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a crashed or hostile peer does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_connections_reset_mid_frame_cost_one_line_and_give_their_tickets_back(start_coordinator, agents, caplog):
    caplog.set_level(logging.INFO, logger="fedpar.server.dataplane")
    init = _arrays(0)
    ids = ["d", "u", "p"]
    server = start_coordinator(init, names=NAMES, data_plane=True, clients_per_round=3, min_available=3,
                               deadline_seconds=30)
    bots = dict(zip(ids, agents(server.address, ids)))
    tasks = {i: bots[i].task() for i in ids}
    layout = ModelLayout.of_arrays(NAMES, init)
    port = tasks["d"].data_port

    s = socket.create_connection(("127.0.0.1", port))  # mid-download
    s.sendall(encode_preamble(OP_DOWNLOAD, tasks["d"].data_ticket))
    s.recv(1000)
    _reset(s)
    header = pb.UploadHeader(auth=bots["u"].auth, round=tasks["u"].round, task_id=tasks["u"].task_id, num_examples=10,
                             steps=1, tensors=layout_to_pb(layout), total_bytes=layout.total_bytes)
    s = socket.create_connection(("127.0.0.1", port))  # mid-upload
    s.sendall(encode_preamble(OP_UPLOAD, tasks["u"].data_ticket) + encode_frame(header.SerializeToString()))
    read_status(s, Deadline(10))
    s.sendall(b"\0" * 100_000)
    _reset(s)
    s = socket.create_connection(("127.0.0.1", port))  # mid-preamble
    s.sendall(encode_preamble(OP_UPLOAD, tasks["p"].data_ticket)[:20])
    _reset(s)
    s = socket.create_connection(("127.0.0.1", port))  # mid-header
    s.sendall(encode_preamble(OP_UPLOAD, tasks["p"].data_ticket) + encode_frame(header.SerializeToString())[:30])
    _reset(s)

    plane = server.data_plane
    end = time.monotonic() + 10
    while (plane.busy or plane.limits._calls) and time.monotonic() < end:
        time.sleep(0.05)
    assert not plane.busy and not plane.limits._calls
    # Each broke off: its ticket's use is given back, and the agent may try again this round.
    got = dataplane.download(dataplane.DataPlaneTarget(server.address, tasks["d"]), layout, 10)
    assert got[0].tobytes() == init[0].tobytes()
    for i, seed in (("u", 1), ("p", 2), ("d", 3)):
        assert dataplane.upload(dataplane.DataPlaneTarget(server.address, tasks[i]), bots[i].auth, tasks[i], layout,
                                _arrays(seed), 10, 1, {}, 10).accepted
    assert server.wait(20)
    np.testing.assert_allclose(server.coordinator.weights[0], sum(_arrays(k)[0] for k in (1, 2, 3)) / 3, rtol=1e-6,
                               atol=1e-6)
    said = [r for r in caplog.records if r.name == "fedpar.server.dataplane"]
    assert not [r for r in said if r.exc_info or r.levelno >= logging.WARNING], [r.getMessage() for r in said]
    assert all("\n" not in r.getMessage() for r in said)
