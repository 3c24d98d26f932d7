"""How a client joins again: threads whose calls were refused under one session join once between them, one join at
a time; a join refused ALREADY_EXISTS (another process holds the host's place) is an IdTaken, not retried."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from fedpar.client.host_stream import CallRefused
from fedpar.client.links import IdTaken, Reconnecting


def test_threads_refused_under_one_session_join_again_once_between_them():
    sessions = [0]  # the session the coordinator knows
    joins_in_progress, most_at_once = [0], [0]
    lock = threading.Lock()
    refused_both = threading.Barrier(2)

    def join() -> None:
        with lock:
            joins_in_progress[0] += 1
            most_at_once[0] = max(most_at_once[0], joins_in_progress[0])
        time.sleep(0.05)  # a join takes a while: a second thread would overlap it if joins were not serialized
        with lock:
            joins_in_progress[0] -= 1
            sessions[0] += 1

    def call() -> str:
        if sessions[0] == 1:  # the coordinator forgot the first session: both threads' calls under it are refused
            refused_both.wait(5)  # before either joins again
            raise CallRefused(grpc.StatusCode.UNAUTHENTICATED, "bad session token: call JoinPopulation again")
        return "ok"

    calls = Reconnecting("h", "127.0.0.1:1", join, first=0.01, cap=0.05, rng=random.Random(0))
    calls.join()
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(calls.call(call))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == ["ok", "ok"]
    assert sessions[0] == 2 and most_at_once[0] == 1  # the first join, then one join again for both threads


def test_a_join_refused_because_another_process_holds_the_host_is_said_and_not_retried():
    joins = []

    def join() -> None:
        joins.append(1)
        raise CallRefused(grpc.StatusCode.ALREADY_EXISTS,
                          "host 'host-0-of-1' is already connected from 127.0.0.1:5000 (heard from 0.1 s ago)")

    calls = Reconnecting("host-0-of-1", "127.0.0.1:1", join, first=0.01, cap=0.05, rng=random.Random(0))
    with pytest.raises(IdTaken) as err:
        calls.join()
    assert joins == [1]
    assert err.value.reason == "host 'host-0-of-1' is already connected from 127.0.0.1:5000 (heard from 0.1 s ago)"
    assert str(err.value).startswith("host-0-of-1: host 'host-0-of-1' is already connected")
