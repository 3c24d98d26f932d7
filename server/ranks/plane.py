"""What every aggregator rank serves agents: the round's global weights to download, and the open round and its
mode that their uploads are checked against (server/uploads.py). The Coordinator (rank 0, server/coordinator.py) is
one; IngestRank (server/ranks/ingest.py) is the others'. The gRPC service and the data plane talk to either through
this surface."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import grpc
import numpy as np

from fedpar.protocol.codec import ModelLayout, WeightPayload, build_payload
from fedpar.server.config import CoordinatorConfig
from fedpar.server.dataplane import TicketBook
from fedpar.server.registry import AgentRecord, AgentRegistry
from fedpar.server.rounds import Refusal, RoundMode, RoundState
from fedpar.server.uploads import per_update


class IngestPlane:
    """The global model as agents download it, and the open round's slots and mode (loop only)."""

    rank = 0  # this process's aggregator rank
    runs_rounds = True  # False: a service's coordinator between runs (server/idle_coordinator.py), with no round

    def __init__(self, config: CoordinatorConfig, names: Sequence[str], weights: Sequence[np.ndarray],
                 registry: AgentRegistry):
        self.config = config
        self.names = list(names)
        self.weights = [np.ascontiguousarray(w) for w in weights]
        self.layout = ModelLayout.of_arrays(self.names, self.weights)
        self.registry = registry
        self.round_id = 0  # last completed round
        self.current: RoundState | None = None
        self.mode: RoundMode | None = None  # the current round's mode (plain, compressed or secure)
        self.payload: WeightPayload | None = None
        self.tickets = TicketBook()  # data-plane transfer tickets
        self.data_port: int | None = None  # set when the data plane listens (server/dataplane.py)
        self.grpc_port: int | None = None  # set when gRPC listens (server/app.py)
        self.on_ready: Callable[[bool], None] | None = None  # told when it starts and stops serving rounds (health)
        self.handed_over = False  # another coordinator on the agents' port takes their calls now (a service's)
        self._executor = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2),
                                            thread_name_prefix="fedpar-coord")

    def _ready(self, serving: bool) -> None:
        """Tell :attr:`on_ready` whether this plane serves rounds now (the health service reports it)."""
        if self.on_ready is not None:
            self.on_ready(serving)

    def restore(self) -> None:
        """Resume saved state before serving (nothing here: only the coordinator checkpoints)."""

    def taking_calls(self) -> None:
        """The agents' calls come here from now on (on the loop, once restored)."""
        self.handed_over = False

    def hand_over(self) -> None:
        """Another coordinator on the agents' port takes their calls from now on (on the loop): long-polls here end
        at once, so that the agents' next ones reach it."""
        self.handed_over = True

    def close(self) -> None:
        """Release the worker threads."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _publish_payload(self, round_id: int) -> None:
        self.payload = await per_update(self.layout.total_bytes, build_payload, round_id, self.layout, self.weights,
                                        self.config.max_chunk_bytes, self.data_port is not None,
                                        min(self.config.inline_weights_max_bytes, self.config.max_chunk_bytes),
                                        executor=self._executor)

    @property
    def current_round_id(self) -> int:
        """The round in progress, else the last one completed."""
        return self.current.round_id if self.current else self.round_id

    def payload_for(self, agent: AgentRecord, round_id: int, task_id: str) -> WeightPayload:
        """The weights an agent may download for its task in ``round_id``."""
        state = self.current
        if state is None or state.round_id != round_id:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"round {round_id} is not the current round; pull a new task")
        state.check_open()
        state.slot_for(agent.agent_id, task_id)
        payload = self.payload
        if payload is None or payload.round_id != round_id:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "weights for this round are not ready; retry")
        return payload
