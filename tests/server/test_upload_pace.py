"""Staging slots are earned by progress: a stream that never sends its header, or uploads that trickle bytes,
are let go, so honest uploads behind them proceed. Real coordinator and agents over loopback (gRPC and the data
plane)."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import numpy as np
import pytest

from fedpar.client import dataplane
from fedpar.client.transfer import encode_data_message, upload_header
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout
from fedpar.models import weight_specs
from fedpar.protocol.dataplane import (OP_UPLOAD, DataPlaneRefused, Deadline, encode_frame, encode_preamble,
                                       read_status, send_all)
from support.abuse import run_under_attack, tiny_model, trickling_uploads
from support.attacks import AGENTS, BEFORE, DURING, TRAIN, check_honest_rounds, coordinator_server

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


def _trickle_in_threads(bots, tasks, stop):
    """Start each bot's trickling upload in a thread; how each ended lands in the returned dict."""
    outcomes: dict[str, tuple] = {}

    def attack(bot):
        try:
            bot.upload(tasks[bot.agent_id], None, 0, messages=_trickle(bot, tasks[bot.agent_id], stop))
        except grpc.RpcError as exc:
            outcomes[bot.agent_id] = (exc.code(), exc.details())

    threads = [threading.Thread(target=attack, args=(b,), daemon=True) for b in bots]
    for t in threads:
        t.start()
    return outcomes, threads


def test_trickling_uploads_give_their_slots_to_a_waiting_honest_upload_at_once(start_coordinator, agents):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], clients_per_round=1, overselect=3.0,
                               min_available=3, max_concurrent_uploads=2, deadline_seconds=30.0)
    slow1, slow2, honest = agents(server.address, ["slow1", "slow2", "honest"], num_examples=10)
    tasks = {b.agent_id: b.task() for b in (slow1, slow2, honest)}
    stop = threading.Event()
    outcomes, threads = _trickle_in_threads((slow1, slow2), tasks, stop)
    time.sleep(0.5)  # both trickling streams now hold the two staging slots, within the 2 s rate grace
    started = time.monotonic()
    reply = honest.upload(tasks["honest"], _ones(), 10, timeout=20)
    waited = time.monotonic() - started
    stop.set()
    for t in threads:
        t.join(10)
    # Undisturbed, this upload takes milliseconds; a slot is taken back within a poll of the waiter (50 ms).
    assert reply.accepted and waited < 0.5, waited
    assert server.wait(10) and server.coordinator.metrics.last["status"] == "ok"
    np.testing.assert_array_equal(server.coordinator.weights[0], _ones()[0])  # only the honest update counted
    overtaken = [d for c, d in outcomes.values() if c == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(overtaken) >= 1 and all("fell behind --upload-min-bytes-per-second" in d for d in overtaken), outcomes
    # the other one ended with the round (one update was enough) if it still held its slot
    assert all(c in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION)
               for c, _ in outcomes.values()), outcomes


def test_a_trickling_upload_alone_loses_its_slot_after_the_rate_grace(start_coordinator, agents):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], clients_per_round=1, min_available=1,
                               upload_idle_seconds=1.0, upload_min_bytes_per_second=4096, deadline_seconds=30.0)
    (slow,) = agents(server.address, ["slow"], num_examples=10)
    stop = threading.Event()
    started = time.monotonic()
    outcomes, threads = _trickle_in_threads((slow,), {"slow": slow.task()}, stop)
    threads[0].join(10)
    stop.set()
    assert 0.9 < time.monotonic() - started < 5  # refused after the grace (here the 1 s idle limit), not later
    code, details = outcomes["slow"]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "is too slow" in details, details
    assert server.coordinator.current.slots["slow"].status == "pending"  # it may send again


def test_a_trickling_data_plane_upload_gives_its_slot_to_a_waiting_one(start_coordinator, agents):
    server = start_coordinator([np.zeros(SHAPE, np.float32)], data_plane=True, clients_per_round=1, overselect=2.0,
                               min_available=2, max_concurrent_uploads=1, deadline_seconds=30.0)
    slow, honest = agents(server.address, ["slow", "honest"], num_examples=10)
    tasks = {b.agent_id: b.task() for b in (slow, honest)}
    layout = ModelLayout.of_arrays(["t0"], _ones())
    header = upload_header(slow.auth, tasks["slow"], layout, 10, 1, {})
    with socket.create_connection(("127.0.0.1", tasks["slow"].data_port)) as s:
        d = Deadline(10)
        send_all(s, encode_preamble(OP_UPLOAD, tasks["slow"].data_ticket) + encode_frame(header.SerializeToString()),
                 d)
        read_status(s, d)  # it holds the only staging slot ...
        time.sleep(0.2)
        send_all(s, b"\0" * 4, d)  # ... and trickles: 4 bytes in 0.2 s
        time.sleep(0.1)
        started = time.monotonic()
        target = dataplane.DataPlaneTarget(server.address, tasks["honest"])
        reply = dataplane.upload(target, honest.auth, tasks["honest"], layout, _ones(), 10, 1, {}, 20.0)
        assert reply.accepted and time.monotonic() - started < 0.5
        with pytest.raises(DataPlaneRefused) as refused:
            read_status(s, d)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "fell behind --upload-min-bytes-per-second" in str(refused.value)
    assert server.wait(10) and server.data_plane.uploads == 1
    np.testing.assert_array_equal(server.coordinator.weights[0], _ones()[0])


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


def test_sampled_agents_trickling_every_upload_keep_honest_rounds_within_2x():
    # Two attacker agents sampled every round, against two staging slots, upload again whenever they are let go.
    specs = weight_specs(tiny_model())
    tricklers = ["trickler-0", "trickler-1"]
    server = coordinator_server(max_concurrent_uploads=2, min_available=AGENTS + 2, overselect=(AGENTS + 2) / AGENTS)
    run = run_under_attack(server, lambda s, *ev: (trickling_uploads, (s.address, tricklers, specs, *ev)),
                           AGENTS, BEFORE, DURING, TRAIN)
    check_honest_rounds(run)
    ends = " | ".join(run.attacker)
    assert "fell behind --upload-min-bytes-per-second" in ends, run.attacker
