"""What an aggregator rank other than 0 answers agents while it is not in the group: a replacement for a lost rank
listens on the lost rank's port before rank 0 takes it back, and an agent of the lost rank that calls it meanwhile
is told to retry (UNAVAILABLE), not that it is unknown (it holds no session yet)."""

from __future__ import annotations

import grpc

from fedpar.server.registry import AgentRecord, AgentRegistry, HostRecord
from fedpar.server.rounds import Refusal


class RankRegistry(AgentRegistry):
    """An aggregator rank's agent sessions, which refuse every call (UNAVAILABLE) until :attr:`admitting`."""

    rank = 0  # the aggregator rank, for the refusal's text
    admitting = True  # whether the rank is in the group (a replacement: once rank 0 took it back)

    def _check_admitting(self) -> None:
        if not self.admitting:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, f"aggregator rank {self.rank} is starting again and waits "
                                                       "for the coordinator to take it back; retry")

    def authenticate(self, agent_id: str, token: str, peer=None) -> AgentRecord:
        """The agent's record (AgentRegistry.authenticate), or UNAVAILABLE while the rank is not in the group."""
        self._check_admitting()
        return super().authenticate(agent_id, token, peer)

    def authenticate_host(self, host_id: str, token: str, peer=None) -> HostRecord:
        """The host's record (AgentRegistry.authenticate_host), or UNAVAILABLE while the rank is not in the group."""
        self._check_admitting()
        return super().authenticate_host(host_id, token, peer)
