"""A simulation host tells the coordinator every member whose availability changed, however many change at once:
more than one request holds are told over several pulls, each within the coordinator's --max-chunk-bytes
(client/links.py HostLink.pull). Real coordinator and host link over loopback gRPC."""

from __future__ import annotations

import numpy as np

from fedpar.client.links import AgentConfig, Connection, HostLink
from support.synthetic_members import SyntheticMembers

MEMBERS = 20_000  # ids of 9 bytes: 220 KB as changes, past the 128 KB a coordinator of 64 KiB chunks takes at once
CHUNK = 64 << 10  # (its joins go 10,000 members a call: 110 KB)


class GoneAtOnce(SyntheticMembers):
    """Members that all go offline at the first pull (and as ``changes`` says after)."""

    def __init__(self):
        super().__init__("m", 0, MEMBERS, 8)
        self.changes = [([self.member_id(i) for i in range(MEMBERS)], [])]

    def availability_changes(self, clock_seconds: float | None) -> tuple[list[str], list[str]]:
        """The next change of the script; then none."""
        return self.changes.pop(0) if self.changes else ([], [])


def test_a_host_tells_every_availability_change_though_they_pass_one_request(start_coordinator):
    # before: all 20,000 went in one request, which the coordinator refused (RESOURCE_EXHAUSTED) at every pull, and
    # a failed pull's changes were not sent again: the coordinator never heard that any member went offline
    server = start_coordinator([np.zeros(8, np.float32)], accept_populations=True, min_available=MEMBERS + 1,
                               max_chunk_bytes=CHUNK)
    config = AgentConfig(server=f"127.0.0.1:{server.port}", agent_id="host-a", insecure=True, poll_seconds=0.2)
    members = GoneAtOnce()
    link = HostLink(Connection(config), config, members, lambda: None, lambda i, task: True)
    link.join()
    registry = server.coordinator.registry
    pulls = 0
    while registry.away_count() < MEMBERS and pulls < 1000:
        link.pull()
        pulls += 1
    assert registry.away_count() == MEMBERS and pulls > 1, pulls
    members.changes.append(([], [members.member_id(i) for i in range(0, MEMBERS, 2)]))  # half come back
    while members.changes or registry.away_count() > MEMBERS // 2:  # those back are told too
        link.pull()
        pulls += 1
        assert pulls < 2000
    assert registry.away_count() == MEMBERS // 2
