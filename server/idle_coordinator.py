"""The coordinator of a service between its runs, and beneath each of them on the agents' port: agents join and
long-poll (so they do not back off while no run is queued), health says SERVING, and no round ever runs. Each run's
coordinator shares its member source, so the agents that joined it are the run's, with the sessions they have."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np

from fedpar.aggregation import build_strategy
from fedpar.server.agent_port import AgentPort
from fedpar.server.app import CoordinatorServer
from fedpar.server.coordinator import Coordinator


class IdleCoordinator(Coordinator):
    """A Coordinator whose run serves until cancelled, dealing no task; its members are kept for the next run."""

    runs_rounds = False  # an update sent to it is of a run that ended: refused in words that say so

    async def run(self) -> None:
        """Serve (health SERVING) until the server stops it."""
        self.keeps_members = True
        self._ready(True)
        try:
            await asyncio.Event().wait()
        finally:
            self._ready(False)
            self.members.finish(tell=False)

    def taking_calls(self) -> None:
        """Between runs no task is required: an agent that joins now is named in no run's log."""
        super().taking_calls()
        self.members.require_task(None)


def idle_server(agent_port: AgentPort) -> CoordinatorServer:
    """A server of an :class:`IdleCoordinator` on ``agent_port``, held to its limits and admission (not started;
    no data plane: it moves no model)."""
    config = replace(agent_port.config, checkpoint_dir=None, data_plane=False)
    coordinator = IdleCoordinator(config, ["idle"], [np.zeros(1, np.float32)], build_strategy("fedavg"),
                                  admission=agent_port.admission)
    return CoordinatorServer(coordinator, agent_port=agent_port)
