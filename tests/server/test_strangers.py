"""Strangers cannot starve honest agents: silent pre-authentication upload streams, unary calls that never send
their request, and idle data-plane sockets,
from another process, against a real coordinator with real agents on loopback. Honest rounds keep completing,
at most 2x slower than the undisturbed rounds of the same run, and every honest download succeeds."""

from __future__ import annotations

import time

import grpc
import numpy as np

from fedpar.protocol.codec import SERVICE_NAME
from support.abuse import idle_sockets, run_under_attack, silent_requests, silent_streams
from support.attacks import AGENTS, BEFORE, DURING, TRAIN, check_honest_rounds, coordinator_server


def test_silent_upload_streams_never_touch_the_honest_budget():
    # 120 silent streams from the agents' own address: over --max-concurrent-rpcs and over both strangers' bounds.
    server = coordinator_server(max_concurrent_rpcs=40, max_unauthenticated_calls=32, max_unauthenticated_per_peer=16,
                                upload_header_seconds=1.0)
    run = run_under_attack(server, lambda s, *ev: (silent_streams, (s.address, 120, None, *ev)),
                           AGENTS, BEFORE, DURING, TRAIN)
    check_honest_rounds(run)
    assert server.strangers.evictions > 0 and len(server.strangers) == 0
    ends = " | ".join(run.attacker)
    assert "--max-unauthenticated-per-peer 16" in ends and "RESOURCE_EXHAUSTED" in ends, run.attacker


def test_idle_data_plane_sockets_hold_no_transfer_thread():
    # 100 idle connections against 16 handshake places (8 per address) and 12 transfer threads.
    server = coordinator_server(data_plane=True, max_dataplane_handshakes=16, max_dataplane_handshakes_per_peer=8,
                                dataplane_handshake_seconds=1.0)
    run = run_under_attack(server, lambda s, *ev: (idle_sockets, ("127.0.0.1", s.coordinator.data_port, 100, *ev)),
                           AGENTS, BEFORE, DURING, TRAIN)
    check_honest_rounds(run)
    plane = server.data_plane
    rounds = BEFORE + 1 + DURING
    assert (plane.downloads, plane.uploads) == (AGENTS * rounds, AGENTS * rounds)  # none fell back to gRPC
    assert run.attacker["closed"] > 100 and plane.strangers.evictions > 0


def test_calls_that_never_send_their_request_are_strangers_too():
    # gRPC would hold a unary call whose request never comes, uncounted: here it is bounded like a silent stream.
    server = coordinator_server(max_concurrent_rpcs=40, max_unauthenticated_calls=32, max_unauthenticated_per_peer=16,
                                upload_header_seconds=1.0)
    run = run_under_attack(server, lambda s, *ev: (silent_requests, (s.address, 120, *ev)),
                           AGENTS, BEFORE, DURING, TRAIN)
    check_honest_rounds(run)
    assert server.strangers.evictions > 0 and len(server.strangers) == 0
    ends = " | ".join(run.attacker)
    assert "--max-unauthenticated-per-peer 16" in ends, run.attacker


def test_a_call_without_its_request_is_let_go_at_the_request_deadline(start_coordinator):
    server = start_coordinator([np.zeros(4, np.float32)], clients_per_round=1, min_available=1,
                               upload_header_seconds=0.5)

    def never():
        time.sleep(5)
        yield b""

    with grpc.insecure_channel(server.address) as channel:
        join = channel.stream_unary(f"/{SERVICE_NAME}/Join")
        started = time.monotonic()
        try:
            join(never(), timeout=10)
            raise AssertionError("a call without its request was answered")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "--upload-header-seconds" in exc.details()
        assert time.monotonic() - started < 3
        for _ in range(100):  # the handler ends just after the client hears its answer
            if len(server.strangers) == 0:
                break
            time.sleep(0.02)
        assert len(server.strangers) == 0
