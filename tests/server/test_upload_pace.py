"""Staging slots are earned by progress: a stream that never sends its header, or uploads that trickle bytes,
are let go, so honest uploads behind them proceed. Real coordinator and agents over loopback gRPC."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np

from fedpar.client.transfer import encode_data_message, upload_header
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout

SHAPE = (64, 64)  # 16 KiB of float32: several chunks of 1 KiB


def _ones(value: float = 1.0):
    return [np.full(SHAPE, value, np.float32)]


def _trickle(bot, task, stop: threading.Event):
    """Header, then one 4-byte chunk every 0.3 s: far below any sane rate, never silent long."""
    layout = ModelLayout.of_arrays(["t0"], _ones())
    yield pb.UploadChunk(header=upload_header(bot.auth, task, layout, 10, 1, {}))
    offset = 0
    while not stop.is_set() and offset < layout.total_bytes:
        time.sleep(0.3)
        yield encode_data_message(offset, b"\0\0\0\0")
        offset += 4


def test_trickling_uploads_lose_their_slots_and_an_honest_upload_goes_through(start_coordinator, agents):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], clients_per_round=1, overselect=3.0,
                               min_available=3, max_concurrent_uploads=2, upload_idle_seconds=1.0,
                               upload_min_bytes_per_second=4096, deadline_seconds=30.0)
    slow1, slow2, honest = agents(server.address, ["slow1", "slow2", "honest"], num_examples=10)
    tasks = {b.agent_id: b.task() for b in (slow1, slow2, honest)}
    stop = threading.Event()
    outcomes: dict[str, grpc.StatusCode] = {}

    def attack(bot):
        try:
            bot.upload(tasks[bot.agent_id], None, 0, messages=_trickle(bot, tasks[bot.agent_id], stop))
        except grpc.RpcError as exc:
            outcomes[bot.agent_id] = (exc.code(), exc.details())

    threads = [threading.Thread(target=attack, args=(b,), daemon=True) for b in (slow1, slow2)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # both trickling streams now hold the two staging slots
    started = time.monotonic()
    reply = honest.upload(tasks["honest"], _ones(), 10, timeout=20)
    assert reply.accepted and time.monotonic() - started < 5  # waited about the 1 s of grace, not the deadline
    stop.set()
    for t in threads:
        t.join(10)
    assert server.wait(10) and server.coordinator.metrics.rows[-1]["status"] == "ok"
    np.testing.assert_array_equal(server.coordinator.weights[0], _ones()[0])  # only the honest update counted
    for code, details in outcomes.values():
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--upload-min-bytes-per-second" in details


def test_a_stream_without_a_header_is_let_go_at_once(start_coordinator, agents):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], clients_per_round=1, min_available=1,
                               upload_header_seconds=0.5, deadline_seconds=30.0)
    (bot,) = agents(server.address, ["mute"], num_examples=10)

    def silence():
        time.sleep(5)
        yield pb.UploadChunk()

    started = time.monotonic()
    try:
        bot.upload(None, None, 0, messages=silence(), timeout=10)
        raise AssertionError("a stream without a header was accepted")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "--upload-header-seconds" in exc.details()
    assert time.monotonic() - started < 3
