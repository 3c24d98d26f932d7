"""Rank 0 taking replacement ranks back (server/ranks/group.py): a replacement counts up in the rendezvous store while
it asks and joins, so that one that hung or died costs its take-back JOINER_SILENT_SECONDS, not --aggregator-timeout
(a stopped replacement held a round 120 s by default). On a real TCPStore; no process group is formed."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from fedpar.server.ranks.group import ALIVE_EVERY_SECONDS, ALIVE_KEY, JOINER_SILENT_SECONDS, RankGroup, RankMissing

NAMESPACE = "fedpar/ranks/test"


@pytest.fixture
def store():
    served = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield served


def _rank_0(store, timeout: float) -> RankGroup:
    """Rank 0's view of the group's store (built as a replacement is: outside any process group, which a take-back
    that fails before every member came never forms)."""
    return RankGroup.replacement(0, 3, "127.0.0.1", store.port, NAMESPACE, timeout)


def test_a_replacement_that_stopped_counting_up_fails_its_take_back_in_seconds_not_the_timeout(store):
    group = _rank_0(store, 60.0)
    started = time.monotonic()
    with pytest.raises(RankMissing, match=r"aggregator rank 2's replacement did not come to form the group: silent "
                                          r"for \d+\.\d s \(it died or hung\)"):
        group.reform([0, 2], {2: "a1b2"})  # asked with nonce a1b2, then stopped: it never counts up again
    assert JOINER_SILENT_SECONDS <= time.monotonic() - started < JOINER_SILENT_SECONDS + 5


def test_a_replacement_still_counting_up_is_waited_for_to_the_configured_timeout(store):
    group = _rank_0(store, JOINER_SILENT_SECONDS + 1)
    alive = dist.PrefixStore(NAMESPACE, dist.TCPStore("127.0.0.1", store.port, is_master=False))
    done = threading.Event()

    def count_up():  # slow to come (a loaded machine), but alive
        while not done.wait(ALIVE_EVERY_SECONDS):
            alive.add(f"{ALIVE_KEY}/2/c3d4", 1)
    beats = threading.Thread(target=count_up, daemon=True)
    beats.start()
    started = time.monotonic()
    try:
        with pytest.raises(RankMissing, match="not every member came within"):
            group.reform([0, 2], {2: "c3d4"})
    finally:
        done.set()
        beats.join()
    assert time.monotonic() - started >= JOINER_SILENT_SECONDS + 1
