"""Rank 0's side of the aggregator ranks (the package's docstring tells one round): :class:`RankLeader` deals
agents to ranks, sends every rank the round's steps (RankBroadcast messages) and combines the ranks' partial sums
at each round's close."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import grpc
import numpy as np

from fedpar.aggregation.arrays import ShapesAndDtypes
from fedpar.aggregation.strategy import Strategy
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.dataplane import TICKET_BYTES
from fedpar.server.ranks.calls import RankCalls
from fedpar.security.tls import TlsFiles
from fedpar.server.ranks.control import HEARTBEAT_SECONDS, add_control_port, control_handler, new_secret
from fedpar.server.ranks.group import RankEndpoint, RankGroup, RankMissing
from fedpar.server.ranks.messages import serial_bytes
from fedpar.server.ranks.stats import STAT_NAMES, ingest_stats
from fedpar.server.rounds import AgentSlot, RoundState

log = logging.getLogger("fedpar.server")


class RankLeader:
    """Rank 0's side: deals agents to ranks, and combines the ranks' partial sums at each round's close."""

    def __init__(self, group: RankGroup, advertised_host: str = "", tls: TlsFiles | None = None):
        self.group = group
        self.tls = tls  # the coordinator's certificate for the control service (None: plaintext)
        self.advertised_host = advertised_host  # what agents dial for this rank ("" = the host they dial already)
        self.endpoints: list[RankEndpoint] = []
        self.secret = new_secret()
        self._control: grpc.aio.Server | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="fedpar-ranks")  # collectives, in order
        self._last_sent = time.monotonic()
        self.calls: RankCalls | None = None  # rank 0's answers to the other ranks' calls, once started
        self._ticker: asyncio.Task | None = None
        self.secure = False  # whether rounds are masked (every upload then goes to rank 0), once started
        self.strategy: Strategy | None = None  # rank 0's, once started
        self.shapes: ShapesAndDtypes | None = None  # of the model, once started

    @property
    def world(self) -> int:
        """The number of aggregator ranks."""
        return self.group.world

    async def _collective(self, fn, *args):
        """Run ``fn(*args)`` (one or more collectives) on the collective thread, after those submitted before; a
        RankMissing names the ranks whose heartbeats stopped."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)
        except RankMissing as exc:
            raise RankMissing(f"{exc}; {self.silent_ranks()}") from None
        finally:
            self._last_sent = time.monotonic()

    def silent_ranks(self) -> str:
        """Which ranks' heartbeats stopped: the ones a failed collective waited for."""
        now, heard = time.monotonic(), self.calls.heard if self.calls is not None else {}
        silent = [r for r in range(1, self.world) if now - heard.get(r, 0.0) > 3 * HEARTBEAT_SECONDS]
        if not silent:
            return "every other rank's heartbeat is still arriving"
        return "no heartbeat from " + ", ".join(
            f"rank {r} for {now - heard[r]:.1f} s" if r in heard else f"rank {r} ever" for r in silent)

    async def _tick(self) -> None:
        """While rank 0 waits (for agents, for a round), keep the other ranks' receive within its timeout."""
        period = self.group.timeout.total_seconds() / 4
        while True:
            await asyncio.sleep(period / 2)
            if time.monotonic() - self._last_sent > period:
                await self._collective(self.group.send, pb.RankBroadcast(tick=pb.RankTick()))

    async def start(self, coordinator) -> None:
        """Learn where every rank listens, open rank 0's control service for them (answered by ``coordinator``'s
        round: server/ranks/calls.py), and give every rank the model to serve (rank 0's, perhaps resumed)."""
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")  # where the other ranks already reach rank 0
        self.calls = RankCalls(coordinator)
        self.strategy, self.shapes = coordinator.strategy, ShapesAndDtypes.of(coordinator.weights)
        # Secure rounds are unmasked where the key shares are: rank 0 takes every masked upload.
        self.secure = coordinator.config.secure_aggregation
        self._control = grpc.aio.server()
        self._control.add_generic_rpc_handlers((control_handler(self.secret, self.world, self.calls),))
        control_port = add_control_port(self._control, host, self.tls)
        await self._control.start()
        me = RankEndpoint(0, self.advertised_host, coordinator.grpc_port or 0, coordinator.data_port or 0)

        def work():
            self.endpoints = self.group.exchange_endpoints(me)
            self.group.send(pb.RankBroadcast(start=pb.RankStart(
                round=coordinator.round_id, control=f"{host}:{control_port}", secret=self.secret)))
            self.group.broadcast_arrays(coordinator.weights)
        await self._collective(work)
        log.info("aggregator ranks: %s", ", ".join(f"rank {e.rank} on port {e.grpc_port}" for e in self.endpoints))
        self._ticker = asyncio.ensure_future(self._tick())

    def deal(self, slots: dict[str, AgentSlot]) -> None:
        """Give each sampled agent the rank with the fewest agents so far (updates are the same size, so this
        spreads the bytes evenly), or rank 0 in secure rounds; a remote agent's data-plane ticket is drawn here for
        its rank to honour."""
        load = [0] * self.world
        for agent_id in sorted(slots):
            rank = 0 if self.secure else min(range(self.world), key=lambda r: (load[r], r))
            load[rank] += 1
            slot = slots[agent_id]
            slot.rank = rank
            if rank and self.endpoints[rank].data_port:
                slot.data_ticket = secrets.token_bytes(TICKET_BYTES)

    def route(self, task: pb.TrainTask, slot: AgentSlot) -> None:
        """Send ``slot``'s agent to the rank it was dealt to for its download and upload (another than rank 0): that
        rank's port, and its data-plane port and ticket."""
        endpoint = self.endpoints[slot.rank]
        task.ingest_port, task.ingest_host = endpoint.grpc_port, endpoint.host
        if slot.data_ticket is not None:
            task.data_port, task.data_ticket = endpoint.data_port, slot.data_ticket

    async def open_round(self, state: RoundState, registry) -> None:
        """Send every rank its agents' slots (with their sessions), before any task is handed out."""
        agents = []
        for slot in state.slots.values():
            record = registry.get(slot.agent_id)
            if slot.rank and record is not None:
                agents.append(pb.RankAgent(rank=slot.rank, agent_id=slot.agent_id, task_id=slot.task_id,
                                           token=record.token, num_examples=record.num_examples,
                                           cert_serial=serial_bytes(record.cert_serial),
                                           ticket=slot.data_ticket or b"", host=record.host or ""))
        opened = pb.RankOpen(round=state.round_id, deadline_seconds=state.deadline_seconds, agents=agents)

        def work():
            self.group.send(pb.RankBroadcast(open=opened))
            self.group.broadcast_floats(self.strategy.round_values())
            self.group.all_present("the round's opening")  # every rank holds the round before any task leaves
        await self._collective(work)

    async def close_round(self, state: RoundState, strategy: Strategy) -> dict[str, float]:
        """Combine every rank's share of the round into rank 0's strategy (the partial sums all-reduced, the updates
        a robust rule needs handed on); the per-rank metrics columns. RuntimeError if a rank folded other than what
        rank 0 counted for it (the round then fails and the model stays)."""
        expected = [sum(1 for s in state.slots.values() if s.rank == r and s.status == "accepted")
                    for r in range(self.world)]

        def work():
            self.group.send(pb.RankBroadcast(close=pb.RankClose(round=state.round_id, expected=expected)))
            self.group.all_present("the round's close")
            stats = self.group.gather_floats(ingest_stats(state, 0) + [float(strategy.folded)])
            started = time.perf_counter()
            self.group.combine(strategy, self.shapes)
            return stats, time.perf_counter() - started
        stats, reduce_seconds = await self._collective(work)
        row = {f"r{r}_{name}": values[i] for r, values in enumerate(stats) for i, name in enumerate(STAT_NAMES)}
        row["allreduce_s"] = reduce_seconds
        # Rank 0 folded its own uploads itself (a secure round: their unmasked sum, once); the others must have
        # folded what rank 0 counted for them.
        folded = [int(values[-1]) for values in stats]
        if folded[1:] != expected[1:]:
            raise RuntimeError(f"round {state.round_id}: the aggregator ranks folded {folded} updates where rank 0 "
                               f"counted {expected}")
        return row

    async def publish(self, round_id: int, weights: Sequence[np.ndarray] | None) -> None:
        """The round's end: the new global model to every rank, or None: the model stays as it was."""
        def work():
            self.group.send(pb.RankBroadcast(model=pb.RankModel(round=round_id, changed=weights is not None)))
            if weights is not None:
                self.group.broadcast_arrays(weights)
        await self._collective(work)

    async def stop(self, finished: bool) -> None:
        """Stop ticking; when every round is ``finished``, the other ranks stop serving too."""
        if self._ticker is not None:
            self._ticker.cancel()
        if finished:
            await self._collective(self.group.send, pb.RankBroadcast(stop=pb.RankStop()))
        if self._control is not None:
            await self._control.stop(0.5)
        self._thread.shutdown(wait=False)
