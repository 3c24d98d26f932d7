"""A client that cannot reach its coordinator waits between tries: doubling, jittered, never above the cap; agents,
`fedpar client` and simulation hosts share one default cap."""

from __future__ import annotations

import random
import time

import grpc
import pytest

from fedpar.cli.agent_setup import Connection
from fedpar.client.backoff import FIRST_BACKOFF_SECONDS, MAX_BACKOFF_SECONDS, Backoff
from fedpar.client.links import AgentConfig, FatalAgentError, Reconnecting
from support.ports import free_port


def test_waits_double_from_the_first_step_and_never_pass_the_cap():
    backoff = Backoff(0.5, 5.0, random.Random(0))
    waits = [backoff.wait() for _ in range(200)]
    for k, step in enumerate([0.5, 1.0, 2.0, 4.0]):  # jittered by a factor in [0.5, 1.5)
        assert 0.5 * step <= waits[k] < 1.5 * step
    assert max(waits) <= 5.0
    capped = waits[4:]
    assert min(capped) >= 2.5 and max(capped) > 4.5  # at the cap the waits still spread, up to the cap


def test_every_client_shares_one_default_cap_low_enough_for_a_quick_rejoin():
    config = AgentConfig(server="127.0.0.1:1", agent_id="a", insecure=True)
    assert config.max_backoff == Connection().max_backoff == MAX_BACKOFF_SECONDS <= 5.0
    assert config.initial_backoff == FIRST_BACKOFF_SECONDS


def test_an_unreachable_coordinator_is_dialled_again_at_least_once_per_cap():
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    channel = grpc.insecure_channel(address)
    ping = channel.unary_unary("/fedpar.Probe/Ping")
    tries: list[float] = []

    def dial() -> None:
        tries.append(time.monotonic())
        ping(b"", timeout=1.0)

    calls = Reconnecting("a", address, join=lambda: None, first=0.02, cap=0.15, rng=random.Random(1),
                         give_up_after=1.2)
    with pytest.raises(FatalAgentError, match="unreachable for 1.2s"):
        calls.call(dial)
    channel.close()
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert len(tries) >= 8
    assert max(gaps) < 0.15 + 0.35  # the wait (at most the cap) and a refused dial on loopback
