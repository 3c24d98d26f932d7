"""The coordinator of a service between its runs: agents join and long-poll (so they do not back off while no run
is queued), health says SERVING, and no round ever runs."""

from __future__ import annotations

import asyncio

import numpy as np

from fedpar.aggregation import build_strategy
from fedpar.server.app import CoordinatorServer
from fedpar.server.config import CoordinatorConfig
from fedpar.server.coordinator import Coordinator


class IdleCoordinator(Coordinator):
    """A Coordinator whose run serves until cancelled, dealing no task; its members are kept for the next run."""

    async def run(self) -> None:
        """Serve (health SERVING) until the server stops it."""
        self.keeps_members = True
        self._ready(True)
        try:
            await asyncio.Event().wait()
        finally:
            self._ready(False)
            self.members.finish(tell=False)


def idle_server(config: CoordinatorConfig, admission, host: str, port: int, credentials, data_tls
                ) -> CoordinatorServer:
    """A server of an :class:`IdleCoordinator` with ``config``'s limits on ``host:port`` (not started)."""
    coordinator = IdleCoordinator(config, ["idle"], [np.zeros(1, np.float32)], build_strategy("fedavg"),
                                  admission=admission)
    return CoordinatorServer(coordinator, host=host, port=port, credentials=credentials, data_tls=data_tls)
