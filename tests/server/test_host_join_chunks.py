"""A simulation host joins its members in calls within the coordinator's --max-chunk-bytes (client/links.py
HostLink.join): the first call within the framing every limit has, the rest within the chunk its reply names. Real
coordinator and host link over loopback gRPC."""

from __future__ import annotations

import numpy as np

from fedpar.client.links import AgentConfig, Connection, HostLink
from fedpar.protocol.codec import MAX_POPULATION_JOIN
from support.synthetic_members import SyntheticMembers

MEMBERS = 12_000  # more than one call's MAX_POPULATION_JOIN


def test_a_host_joins_every_member_of_a_coordinator_of_small_chunks(start_coordinator):
    # before: 10,000 members a call (about 110 KB) against the 68 KB a coordinator of 4 KiB chunks takes, refused
    # (RESOURCE_EXHAUSTED) at every try: `fedpar simulate-workers` said 'coordinator unreachable' for ever
    assert MEMBERS > MAX_POPULATION_JOIN
    server = start_coordinator([np.zeros(8, np.float32)], accept_populations=True, min_available=MEMBERS + 1,
                               max_chunk_bytes=4096)
    config = AgentConfig(server=f"127.0.0.1:{server.port}", agent_id="host-a", insecure=True, poll_seconds=0.2)
    link = HostLink(Connection(config), config, SyntheticMembers("m", 0, MEMBERS, 8), lambda: None,
                    lambda i, task: True)
    link.join()
    registry = server.coordinator.registry
    assert registry.host("host-a").members == MEMBERS == len(registry)
    assert link.max_chunk == 4096
