"""A simulation host sends all its members' updates, round after round, on one HostUploadStream: the coordinator sees
one stream per host for the whole run (one of its --max-concurrent-rpcs places, not one per seat or batch)."""

from __future__ import annotations

import collections

from fedpar.cli.main import main
from fedpar.server.app import CoordinatorService

ROUNDS = 3


def test_the_coordinator_sees_one_upload_stream_per_host_over_the_rounds(tmp_path, monkeypatch):
    opened: collections.Counter = collections.Counter()  # streams per host, from each stream's first message
    open_now: collections.Counter = collections.Counter()
    most_at_once: collections.Counter = collections.Counter()
    batches: collections.Counter = collections.Counter()
    serve = CoordinatorService.HostUploadStream

    async def counted(self, request_iterator, context):
        host = None

        async def noted():
            nonlocal host
            async for request in request_iterator:
                if host is None and hasattr(request, "host"):
                    host = request.host.agent_id
                    opened[host] += 1
                    open_now[host] += 1
                    most_at_once[host] = max(most_at_once[host], open_now[host])
                batches[host] += 1
                yield request

        try:
            async for reply in serve(self, noted(), context):
                yield reply
        finally:
            if host is not None:
                open_now[host] -= 1

    monkeypatch.setattr(CoordinatorService, "HostUploadStream", counted)  # the coordinator runs in this process
    assert main(["simulate", "--clients", "8", "--workers", "2", "--seats", "2", "--quiet", "--dataset", "digits",
                 "--model", "mlp", "--rounds", str(ROUNDS), "--local-epochs", "1", "--batch-size", "32",
                 "--seed", "3", "--out", str(tmp_path)]) == 0
    assert len(opened) == 2 and set(opened.values()) == {1}, opened
    assert set(most_at_once.values()) == {1}, most_at_once
    assert all(n >= ROUNDS for n in batches.values()), batches  # every round's updates went on that one stream
