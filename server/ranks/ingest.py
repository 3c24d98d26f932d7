"""An aggregator rank other than 0 (server/ranks/): an ingest plane that follows rank 0's rounds.

It serves the global model to the agents rank 0 dealt to it and takes their uploads through the same gRPC
service, data plane and upload intake as rank 0, with the same checks. A complete, checked upload is counted
by rank 0 (which alone decides first-K, the deadline and duplicates) and then folded into this rank's own
strategy, whose running sum joins the all-reduce at the round's close. Agents join and pull tasks at rank 0.
When a collective fails (another rank died or hangs), this rank waits for rank 0 to form the group again and
follows it from rank 0's next message; a rank that rank 0 declared lost leaves. A replacement for a lost rank asks
rank 0 to take it back (in the rendezvous store) and follows rank 0 from the round it is taken back at.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Sequence

import grpc
import numpy as np

from fedpar.aggregation.accumulator import ShapesAndDtypes
from fedpar.protocol.heap import count_round, trim_heap
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.security.tls import TlsFiles
from fedpar.server.config import CoordinatorConfig
from fedpar.server.ranks.control import HEARTBEAT_SECONDS, RankControlClient
from fedpar.server.ranks.group import RankEndpoint, RankGroup, RankLeftOut, RankMissing
from fedpar.server.ranks.messages import RankMessageError, serial_number
from fedpar.server.ranks.gate import RankRegistry
from fedpar.server.ranks.plane import IngestPlane
from fedpar.server.ranks.steps import CollectiveThread
from fedpar.server.registry import AgentRecord, speaker
from fedpar.server.round_modes import RoundModes
from fedpar.server.rounds import AgentSlot, Refusal, RoundState, ingest_stats

log = logging.getLogger("fedpar.server")
LEAVE_AFTER_RANK0_SECONDS = 2.0


class IngestRank(IngestPlane):
    """Rank ``group.rank`` of a coordinator's aggregator ranks; :meth:`run` follows rank 0 until the last round."""

    def __init__(self, config: CoordinatorConfig, names: Sequence[str], weights: Sequence[np.ndarray], strategy,
                 group: RankGroup, admission=None, advertised_host: str = "", control_tls: TlsFiles | None = None):
        config.validate()
        sessions = RankRegistry(float("inf"), admission=admission)
        sessions.rank, sessions.admitting = group.rank, not group.replacing  # a replacement: once taken back
        super().__init__(config, names, weights, sessions)
        self.sessions = sessions
        self.rank = group.rank
        self.group = group
        self.strategy = strategy
        strategy.accumulate_in(config.fold_dtype, group.fold_device)
        self.advertised_host = advertised_host
        self.control_tls = control_tls  # the coordinator's certificate files, to check rank 0's control service
        self.shapes = ShapesAndDtypes.of(self.weights)
        self.mode = RoundModes(config, self.names, self.weights, strategy, self._executor).run_mode
        self.finished = False
        self.left_out = False  # rank 0 declared this rank lost and went on without it
        self.control: RankControlClient | None = None
        self._counted = 0  # uploads rank 0 counted for this rank in the open round
        self._counted_more = asyncio.Event()  # set as _counted grows: a close waiting for counts wakes on it
        self._reports: dict[str, pb.RankUpload] = {}  # this round's count messages, by agent
        self._steps = CollectiveThread(group)  # collectives, in order

    async def _receive(self) -> pb.RankBroadcast:
        return await self._collective(self.group.receive)

    async def _collective(self, fn, *args):
        """``fn(*args)`` on the collective thread; given up (RankMissing) once rank 0 formed the group again
        meanwhile: the step waited for a lost rank other than rank 0, which rank 0's leaving does not wake."""
        return await self._steps.run(fn, *args, lost=self._reformed)

    async def _forming(self, fn, *args):
        """``fn(*args)``, a step that joins the group, on the collective thread (it fails by itself)."""
        return await self._steps.run(fn, *args)

    async def _reformed(self) -> str | None:
        if await asyncio.to_thread(self.group.reformed):
            return f"aggregator rank {self.rank}: rank 0 formed the group again without a lost rank"
        return None

    async def run(self) -> None:
        """Follow rank 0's messages (start, open, close, model, stop) until every round is done."""
        me = RankEndpoint(self.rank, self.advertised_host, self.grpc_port or 0, self.data_port or 0)
        heartbeat = None
        try:
            if self.group.replacing:  # rank 0 takes it back when the next round opens
                try:
                    await self._forming(self.group.ask_to_join, me)
                except RankMissing as exc:
                    log.info("%s; this rank leaves", exc)
                    return
            else:
                await self._forming(self.group.exchange_endpoints, me)
            log.info("aggregator rank %d (pid %d) serving on port %d, %s", self.rank, os.getpid(), me.grpc_port,
                     f"data plane on port {me.data_port}" if me.data_port else "no data plane (--data-port)")
            while True:
                try:
                    message = await self._receive()
                    kind = message.WhichOneof("kind")
                    if kind == "start" and heartbeat is None:
                        start = message.start
                        self.control = RankControlClient(start.control, start.secret, self.rank,
                                                         self.config.aggregator_timeout_seconds, self.control_tls)
                        heartbeat = asyncio.ensure_future(self._heartbeat())
                    await self._follow(message)
                except RankLeftOut as exc:
                    log.warning("%s; this rank leaves", exc)
                    self.left_out = True
                    return
                except RankMissing as exc:
                    failure = str(exc)  # not the exception: its frames hold the failed group, which must close
                else:
                    if kind == "stop":
                        return
                    continue
                try:  # another rank was lost: rank 0 forms the group again, then its next message comes
                    log.info("rank %d: %s; waiting for rank 0 to form the group again", self.rank, failure)
                    await self._forming(self.group.rejoin)
                except RankLeftOut as left:
                    log.warning("%s; this rank leaves", left)
                    self.left_out = True
                    return
                except RankMissing:
                    # Leave a moment after rank 0 would: its diagnosis names the silent rank, and the launcher
                    # reports the first rank to fail.
                    await asyncio.sleep(LEAVE_AFTER_RANK0_SECONDS)
                    raise
        finally:
            self.finished = True
            self._ready(False)
            if heartbeat is not None:
                heartbeat.cancel()
            self._steps.close()
            if self.control is not None:
                await self.control.close()

    async def _follow(self, message: pb.RankBroadcast) -> None:
        """Do what rank 0's ``message`` says (a step rank 0 sends again after the group formed again does no harm
        done twice)."""
        kind = message.WhichOneof("kind")
        if kind == "start":
            await self._new_model(message.start.round)
            self._ready(True)
            self.sessions.admitting = True  # a replacement is in the group, with the model: agents may call
        elif kind == "open":
            await self._open(message.open)
        elif kind == "close":
            await self._close(message.close)
        elif kind == "model":
            if message.model.changed:
                await self._new_model(message.model.round)
            else:
                await self._in_thread(self.strategy.abort_round)
                self.round_id = message.model.round

    async def _heartbeat(self) -> None:
        """Tell rank 0 this rank is alive, so a failed collective can name the ranks that are not."""
        loop = asyncio.get_running_loop()
        while True:
            sent = loop.time()
            await self._tell("Alive", pb.RankAlive())
            await asyncio.sleep(max(0.0, sent + HEARTBEAT_SECONDS - loop.time()))  # one a second, however slow a reply

    async def _new_model(self, round_id: int) -> None:
        """Receive rank 0's model in place and serve it for the next round."""
        weights = [np.empty_like(w) for w in self.weights]  # the served payload may still view the old ones
        await self._collective(self.group.broadcast_arrays, weights)
        self.weights, self.round_id = weights, round_id
        await self._publish_payload(round_id + 1)
        count_round()
        await self._in_thread(trim_heap)  # a round's freed buffers leave the process, as on rank 0

    async def _open(self, opened: pb.RankOpen) -> None:
        """A round opened: take the sessions and slots of the agents dealt to this rank."""
        round_id = opened.round
        slots = {}
        self.tickets.expire_rounds_before(round_id)
        # sessions of agents dealt here in earlier rounds: kept while a late upload may still come, then forgotten
        self.registry.expire(self.config.deadline_seconds + self.config.liveness_timeout_seconds)
        for host in opened.hosts:  # their members' updates come here in batches and partials
            self.registry.admit_host_session(host.host_id, host.token, serial_number(host.cert_serial))
        for agent in opened.agents:
            if agent.rank != self.rank:
                continue
            record = self.registry.admit_session(agent.agent_id, agent.token, agent.num_examples,
                                                 serial_number(agent.cert_serial), agent.host or None)
            slots[agent.agent_id] = AgentSlot(agent.agent_id, agent.task_id, rank=self.rank)
            if agent.ticket:
                self.tickets.admit(agent.ticket, agent.agent_id, round_id, agent.task_id, speaker(record))
        self.strategy.set_round_values(list(opened.round_values))
        await self._in_thread(self.strategy.begin_round, round_id, self.weights)
        self._counted = 0
        self._reports = {}
        self.current = RoundState(round_id, len(slots), 0, opened.deadline_seconds, slots,
                                  on_reject=self._rejected, on_count=self._count)
        await self._collective(self.group.all_present, "the round's opening")  # rank 0 then hands out tasks

    def _rejected(self, slot: AgentSlot, reason: str) -> None:
        """An update refused here for good (bad content, or this rank's strategy): rank 0 records it too."""
        rejection = pb.RankRejection(round=self.current.round_id, agent_id=slot.agent_id, task_id=slot.task_id,
                                     counted=self._reports.get(slot.agent_id), reason=reason)
        asyncio.ensure_future(self._tell("Reject", rejection))

    async def _close(self, closed: pb.RankClose) -> None:
        """The round closed at rank 0: wait for the folds of every upload it counted here, then add up."""
        if len(closed.expected) != self.group.world:
            raise RankMessageError(f"rank 0 sent a RankClose with {len(closed.expected)} counts for "
                                   f"{self.group.world} ranks")
        state = self.current
        state.close("closed by rank 0")
        expected = closed.expected[self.rank]
        try:  # a count's reply may still be on its way: wait for it (each wakes this wait), not for a poll's tick
            async with asyncio.timeout(self.config.aggregator_timeout_seconds / 2):
                while self._counted < expected:
                    self._counted_more.clear()
                    await self._counted_more.wait()
        except TimeoutError:
            pass
        if state.pending_folds:
            await asyncio.gather(*state.pending_folds, return_exceptions=True)
        stats = ingest_stats(state, self.rank) + [float(self.strategy.folded)]

        await self._collective(self.group.combine, self.strategy, self.shapes, stats)

    def download_completed(self, agent_id: str, round_id: int, task_id: str) -> None:
        """Tell rank 0 the agent has its weights (so its task is not handed out again)."""
        if self.control is not None:
            asyncio.ensure_future(self._tell("Downloaded", pb.RankDownload(round=round_id, agent_id=agent_id,
                                                                           task_id=task_id)))

    async def _tell(self, name: str, message) -> None:
        try:
            await self.control.call(name, message)
        except Refusal as r:
            log.info("rank %d: rank 0 did not take %s: %s", self.rank, name, r.message)

    async def _count(self, state: RoundState, slots: list[AgentSlot], reports: list[tuple[int, dict[str, float]]]
                     ) -> None:
        """Have rank 0 count complete, checked updates (one agent's, or the members of a host's partial) before they
        are counted and folded here: all of them, or a Refusal if rank 0 refuses them (then none is)."""
        uploads = [pb.RankUpload(round=state.round_id, agent_id=slot.agent_id, task_id=slot.task_id,
                                 num_examples=examples, metrics=metrics, upload_bytes=slot.upload_bytes)
                   for slot, (examples, metrics) in zip(slots, reports)]
        await self.control.call("Count", pb.RankUploads(uploads=uploads, count=len(uploads)))
        self._reports.update((u.agent_id, u) for u in uploads)
        self._counted += len(uploads)
        self._counted_more.set()

    # Agents join and pull their tasks at rank 0.
    def join(self, agent_id: str, *args, **kwargs) -> AgentRecord:
        """Refused: agents join rank 0."""
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                      f"this is aggregator rank {self.rank}, which only moves weights; join the coordinator's rank 0")

    async def next_task(self, agent: AgentRecord, *args, **kwargs):
        """Refused: tasks come from rank 0."""
        self.join(agent.agent_id)

    def leave(self, agent: AgentRecord) -> None:
        """Nothing to do: agents leave rank 0."""

    @property
    def secure(self) -> None:
        """None: in secure rounds rank 0 takes every masked upload and the key exchange (server/ranks/leader.py)."""
        return None
