"""Rank 0's side of the aggregator ranks (the package's docstring tells one round): :class:`RankLeader` deals
agents to ranks, sends every rank the round's steps (RankBroadcast messages) and combines the ranks' partial sums
at each round's close. When a rank dies or hangs (its heartbeats stop for LOST_AFTER_SECONDS, its process ends, or a
collective fails), rank 0 forms the group again over the ranks whose heartbeats still arrive; the lost ranks' share
of the open round is dropped and the coordinator goes on with the others. A replacement for a lost rank (a fresh
process in its slot, which asks in the rendezvous store) is taken back when the next round opens: the group is
formed again with it, and it gets the model."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from typing import Callable, Sequence

import grpc
import numpy as np

from fedpar.aggregation.accumulator import ShapesAndDtypes
from fedpar.aggregation.strategy import Strategy
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import grpc_target
from fedpar.protocol.dataplane import TICKET_BYTES
from fedpar.server.ranks.calls import RankCalls
from fedpar.security.tls import TlsFiles
from fedpar.server.ranks.control import HEARTBEAT_SECONDS, add_control_port, control_handler, new_secret
from fedpar.server.ranks.group import RankEndpoint, RankGroup, RankMissing, first_line
from fedpar.server.ranks.messages import serial_bytes
from fedpar.server.ranks.steps import POLL_SECONDS, CollectiveThread
from fedpar.server.rounds import STAT_NAMES, AgentSlot, RoundState, ingest_stats

log = logging.getLogger("fedpar.server")
LOST_AFTER_SECONDS = 3 * HEARTBEAT_SECONDS  # a rank whose heartbeat stopped this long is lost
STALL_SECONDS = 1.0  # rank 0's own loop stood still this long: the heartbeats it did not take yet are not late
REFORM_TRIES = 3  # attempts to form the group again (a rank may be lost while it forms)
STOP_SEND_SECONDS = 2.0  # what rank 0, stopped early, waits at most to tell the other ranks to stop


class RanksChanged(RankMissing):
    """A collective failed and rank 0 formed the group again without the lost ranks: the step is to be retried
    (or given up) by its caller."""


class RankLeader:
    """Rank 0's side: deals agents to the live ranks, combines their partial sums at each round's close, and goes on
without a rank that is lost."""

    def __init__(self, group: RankGroup, advertised_host: str = "", tls: TlsFiles | None = None,
                 on_lost: Callable[[list[int]], None] | None = None, ended: Callable[[int], bool] | None = None):
        self.group = group
        self.on_lost = on_lost  # told the ranks declared lost (simulate's launcher ends their processes)
        self.ended = ended  # whether a rank's process is known to have ended (simulate's launcher knows): lost at once
        self.lost: list[int] = []  # ranks declared lost, in order
        self._lock = asyncio.Lock()  # one step of collectives, or one re-forming, at a time
        self._broken: str | None = None  # why the group could not be formed again, if it could not
        self.tls = tls  # the coordinator's certificate for the control service (None: plaintext)
        self.advertised_host = advertised_host  # what agents dial for this rank ("" = the host they dial already)
        self.endpoints: dict[int, RankEndpoint] = {}  # by rank: the group may lack one (lost), a later one taken back
        self.secret = new_secret()
        self._control: grpc.aio.Server | None = None
        self._steps = CollectiveThread(group)  # collectives, in order
        self._last_sent = time.monotonic()
        self.calls: RankCalls | None = None  # rank 0's answers to the other ranks' calls, once started
        self.coordinator = None  # whose model a replacement rank is given, once started
        self._control_target = ""  # where the other ranks call rank 0's control service, once started
        self._ticker: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._watching_since = self._last_check = time.monotonic()  # heartbeats count as late from then on
        self.secure = False  # whether rounds are masked (every upload then goes to rank 0), once started
        self.strategy: Strategy | None = None  # rank 0's, once started
        self.shapes: ShapesAndDtypes | None = None  # of the model, once started
        self._started = False  # whether the start's collectives were queued (every later message follows them)

    @property
    def world(self) -> int:
        """The number of aggregator ranks."""
        return self.group.world

    @property
    def live(self) -> list[int]:
        """The ranks in the group now (rank 0 first)."""
        return self.group.members

    async def _collective(self, fn, *args, state: RoundState | None = None, watched: bool = True,
                          among: list[int] | None = None, joining: Sequence[int] = ()):
        """Run ``fn(*args)`` (one or more collectives) on the collective thread, one step at a time. When one fails,
        or a rank it waits for is lost meanwhile (its heartbeat stopped, or its process ended: the step is given
        up), the group is formed again over the ranks still alive, the lost ones' uploads in ``state`` (the open
        round) are no longer counted, and RanksChanged says the step did not complete; RankMissing if the group
        cannot be formed again. A step not ``watched`` (the start's, before the heartbeats start) is not given up: it
        fails by itself; one watched ``among`` some ranks is given up only for those, and for a rank ``joining`` whose
        process ended (a take-back's: its replacements send no heartbeat before their start message)."""
        async with self._lock:
            if self._broken is not None:  # the group could not be formed again: every step fails the same way
                raise RankMissing(self._broken)
            try:
                lost = (lambda: self._lost_now(among, joining)) if watched else None
                return await self._steps.run(fn, *args, lost=lost)
            except RankMissing as exc:
                failure = str(exc)  # not the exception: its frames hold the failed group, which must close
            finally:
                self._last_sent = time.monotonic()
            try:
                await self._survive(failure, state)
            except RankMissing as exc:
                self._broken = str(exc)
                raise
            raise RanksChanged(failure)

    async def _survive(self, failure: str, state: RoundState | None) -> None:
        """Form the group again over rank 0 and the ranks whose heartbeats still arrive; drop the others."""
        before = list(self.group.members)
        await self._steps.run(self.group.leave)  # the ranks waiting in a collective wake up
        for _ in range(REFORM_TRIES):
            alive = [0] + await self._heard_again(before[1:])
            try:
                await self._steps.run(self.group.reform, alive)
            except RankMissing as exc:  # a rank was lost while the group formed: try again without it
                failure = str(exc)
                continue
            self._drop([r for r in before if r not in alive], state)
            self._last_sent = time.monotonic()
            return
        raise RankMissing(f"{failure}; {self.silent_ranks()}; the aggregator ranks could not form their group again")

    async def _heard_again(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` whose heartbeat arrives again, once each is either heard from (alive), silent for
        LOST_AFTER_SECONDS or its process known to have ended (lost; a rank never heard from is counted silent from
        now): at most that long, less when the lost ones were silent already (a hung rank, which the failed collective
        waited for) or are known dead."""
        start = time.monotonic()
        while True:
            now, heard = time.monotonic(), self.calls.heard if self.calls is not None else {}
            dead = [r for r in ranks if self.ended is not None and self.ended(r)]
            alive = [r for r in ranks if heard.get(r, start) > start and r not in dead]
            if all(r in alive or r in dead or now - heard.get(r, start) >= LOST_AFTER_SECONDS for r in ranks):
                return alive
            await asyncio.sleep(HEARTBEAT_SECONDS / 10)

    def _drop(self, lost: list[int], state: RoundState | None) -> None:
        """Go on without ``lost``: their calls are refused from now on and their uploads in ``state`` not counted."""
        if not lost:
            return
        self.lost.extend(lost)
        dropped = self.calls.drop(lost, state) if self.calls is not None else 0
        where = f"; their {dropped} upload(s) of round {state.round_id} are not counted" if state is not None else ""
        log.warning("aggregator ranks: %s lost (died or hung); going on with %d of %d ranks (%s)%s",
                    ", ".join(f"rank {r}" for r in lost), len(self.live), self.world,
                    ", ".join(str(r) for r in self.live), where)
        if self.on_lost is not None:
            self.on_lost(lost)

    def silent_ranks(self) -> str:
        """Which ranks' heartbeats stopped: the ones a failed collective waited for."""
        now, heard = time.monotonic(), self.calls.heard if self.calls is not None else {}
        silent = [r for r in self.live[1:] if now - heard.get(r, 0.0) > LOST_AFTER_SECONDS]
        if not silent:
            return "every other rank's heartbeat is still arriving"
        return "no heartbeat from " + ", ".join(
            f"rank {r} for {now - heard[r]:.1f} s" if r in heard else f"rank {r} ever" for r in silent)

    def _silence(self, among: list[int] | None = None, joining: Sequence[int] = ()) -> str | None:
        """Why a rank in the group (or of ``among``) is lost now (its process ended, or its heartbeat stopped
        LOST_AFTER_SECONDS ago), or one ``joining`` it (its process ended), or None."""
        now, heard = time.monotonic(), self.calls.heard if self.calls is not None else {}
        for rank in joining:
            if self.ended is not None and self.ended(rank):
                return f"aggregator rank {rank}'s replacement process ended before it was taken back"
        for rank in self.live[1:] if among is None else among:
            if self.ended is not None and self.ended(rank):
                return f"aggregator rank {rank}'s process ended"
            last = max(heard.get(rank, 0.0), self._watching_since)
            if now - last > LOST_AFTER_SECONDS:
                return f"no heartbeat from aggregator rank {rank} for {now - last:.1f} s"
        return None

    async def _lost_now(self, among: list[int] | None = None, joining: Sequence[int] = ()) -> str | None:
        """:meth:`_silence`, unless rank 0's own loop just stood still (it took no heartbeat meanwhile: they may be
        waiting to be taken, not late)."""
        now = time.monotonic()
        if now - self._last_check > STALL_SECONDS:
            self._watching_since = now
        self._last_check = now
        return self._silence(among, joining)

    async def _watch(self) -> None:
        """Find a lost rank within LOST_AFTER_SECONDS, not at the next collective: between steps, form the group
        again without it at once (a step in progress gives itself up: :meth:`_collective`)."""
        while True:
            await asyncio.sleep(POLL_SECONDS)
            if await self._lost_now() is None or self._lock.locked():
                continue
            state = self.calls.coordinator.current
            try:
                await self._collective(self._fail_if_lost,
                                       state=state if state is not None and not state.closed else None)
            except RanksChanged:
                pass
            except RankMissing:  # the coordinator's next step fails the same way and says why
                return

    def _fail_if_lost(self) -> None:
        """A step that fails (RankMissing) if a rank is lost still, now that it holds the group."""
        reason = self._silence()
        if reason is not None:
            raise RankMissing(reason)

    async def _tick(self) -> None:
        """While rank 0 waits (for agents, for a round), keep the other ranks' receive within its timeout."""
        period = self.group.timeout.total_seconds() / 4
        while True:
            await asyncio.sleep(period / 2)
            if time.monotonic() - self._last_sent > period:
                state = self.calls.coordinator.current
                try:
                    await self._collective(self.group.send, pb.RankBroadcast(tick=pb.RankTick()),
                                           state=state if state is not None and not state.closed else None)
                except RanksChanged:
                    pass
                except RankMissing:  # the coordinator's next step fails the same way and says why
                    return

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
        self.coordinator, self._control_target = coordinator, grpc_target(host, control_port)

        def work():
            self.endpoints = {e.rank: e for e in self.group.exchange_endpoints(me)}
            self._send_start()
        self._started = True
        while True:
            try:
                await self._collective(work, watched=False)
                break
            except RanksChanged:  # a rank died between a service's runs: the group went on without it (it is
                pass              # taken back when a round opens, once its replacement asks)
        log.info("aggregator ranks: %s",
                 ", ".join(f"rank {e.rank} on port {e.grpc_port}" for e in self.endpoints.values()))
        self._ticker = asyncio.ensure_future(self._tick())
        self._watching_since = time.monotonic()  # the ranks' heartbeats start with the start message
        self._watcher = asyncio.ensure_future(self._watch())

    def _send_start(self) -> None:
        """Every rank: where rank 0's control service is and its secret, and the model to serve (rank 0's now)."""
        self.group.send(pb.RankBroadcast(start=pb.RankStart(
            round=self.coordinator.round_id, control=self._control_target, secret=self.secret)))
        self.group.broadcast_arrays(self.coordinator.weights)

    async def _take_back(self) -> bool:
        """Form the group again with the replacement ranks that asked to be taken back, and give them the model;
        whether any were (RanksChanged if a rank was lost meanwhile: they are then left out again)."""
        asking = await self._steps.run(self.group.asking_to_join)
        # A slot out of the group whose process ended (a replacement that died, asking or after a failed take-back)
        # gets another, as a lost rank does; one that died asking would leave the group's forming waiting for it.
        ended = [r for r in range(1, self.world) if r not in self.live and self.ended is not None and self.ended(r)]
        gone = [r for r in ended if r in asking]
        for rank in gone:
            del asking[rank]
            await self._steps.run(self.group.forget_asking, rank)
        if gone:
            log.warning("aggregator ranks: %s's replacement ended before it was taken back",
                        ", ".join(f"rank {r}" for r in gone))
        if ended and self.on_lost is not None:
            self.on_lost(ended)
        if not asking:
            return False
        heartbeating = [r for r in self.live[1:] if r not in asking]  # a rank of these that hangs gives the step up

        def work():  # the group as it is once this step holds it (a rank lost meanwhile is not formed with)
            members = sorted(set(self.live) | set(asking))
            self.group.reform(members, {rank: nonce for rank, (nonce, _) in asking.items()})
            self._send_start()
        for rank, (_, endpoint) in asking.items():
            self.endpoints[rank] = endpoint
        self.calls.take_back(list(asking))
        lost_before = len(self.lost)
        try:
            await self._collective(work, among=heartbeating, joining=list(asking))
        except RanksChanged as exc:
            log.warning("aggregator ranks: taking %s back failed (%s); a live replacement asks again",
                        ", ".join(f"rank {r}" for r in asking if r not in self.live), exc)
            self.calls.lost.update(r for r in asking if r not in self.live)
            # a replacement whose process ended gets another, as a lost rank does (unless the group, formed with it
            # just before, dropped it as lost: that started one already)
            ended = [r for r in asking if r not in self.live and r not in self.lost[lost_before:]
                     and self.ended is not None and self.ended(r)]
            if ended and self.on_lost is not None:
                self.on_lost(ended)
            raise
        log.warning("aggregator ranks: %s taken back; going on with %d of %d ranks (%s)",
                    ", ".join(f"rank {r}" for r in asking), len(self.live), self.world,
                    ", ".join(str(r) for r in self.live))
        return True

    def deal(self, slots: dict[str, AgentSlot]) -> None:
        """Give each sampled agent the rank with the fewest agents so far (updates are the same size, so this
        spreads the bytes evenly), or rank 0 in secure rounds; a remote agent's data-plane ticket is drawn here for
        its rank to honour."""
        load = [0] * self.world
        for agent_id in sorted(slots):
            rank = 0 if self.secure else min(self.live, key=lambda r: (load[r], r))
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
        """Take back the replacement ranks that asked, then send every rank its agents' slots (with their sessions),
        before any task is handed out."""
        while True:
            try:
                if await self._take_back():
                    self.deal(state.slots)  # the replacements take their share of this round
                return await self._collective(self._open_work(state, registry))
            except RanksChanged:  # no task was handed out yet: deal the cohort over the ranks left
                self.deal(state.slots)

    def _open_work(self, state: RoundState, registry):
        """The collectives that open ``state``'s round on every rank."""
        agents, hosts = [], {}
        dealt = [slot for slot in state.slots.values() if slot.rank]
        for slot, record in zip(dealt, registry.get_many([slot.agent_id for slot in dealt])):
            if record is None:
                continue
            agents.append(pb.RankAgent(rank=slot.rank, agent_id=slot.agent_id, task_id=slot.task_id,
                                       token=record.token, num_examples=record.num_examples,
                                       cert_serial=serial_bytes(record.cert_serial),
                                       ticket=slot.data_ticket or b"", host=record.host or ""))
            host = registry.host(record.host) if record.host and record.host not in hosts else None
            if host is not None:
                hosts[host.host_id] = pb.RankHost(host_id=host.host_id, token=host.token,
                                                  cert_serial=serial_bytes(host.cert_serial))

        def work():
            self.group.send(pb.RankBroadcast(open=pb.RankOpen(
                round=state.round_id, deadline_seconds=state.deadline_seconds, agents=agents,
                round_values=self.strategy.round_values(), hosts=list(hosts.values()))))
            self.group.all_present("the round's opening")  # every rank holds the round before any task leaves
        return work

    async def close_round(self, state: RoundState, strategy: Strategy) -> dict[str, float]:
        """Combine every rank's share of the round into rank 0's strategy (the partial sums all-reduced, the updates
        a robust rule needs handed on); the per-rank metrics columns. RuntimeError if a rank folded other than what
        rank 0 counted for it (the round then fails and the model stays)."""
        while True:
            expected = [sum(1 for s in state.slots.values() if s.rank == r and s.status == "accepted")
                        for r in range(self.world)]
            adding = []  # set once every rank is there and the sums start to move: a failure then fails the round

            def work():
                self.group.send(pb.RankBroadcast(close=pb.RankClose(round=state.round_id, expected=expected)))
                started = time.perf_counter()
                stats = self.group.combine(strategy, self.shapes, ingest_stats(state, 0) + [float(strategy.folded)],
                                           gathered=lambda: adding.append(True))
                return stats, time.perf_counter() - started
            try:
                stats, reduce_seconds = await self._collective(work, state=state)
                break
            except RanksChanged:
                if adding:  # the partial sums may be half added up: the round fails and the model stays
                    raise RuntimeError(f"round {state.round_id}: an aggregator rank was lost while the partial sums "
                                       "were added up") from None
        zeros = [0.0] * len(STAT_NAMES)  # a lost rank's columns
        row = {f"r{r}_{name}": stats.get(r, zeros)[i] for r in range(self.world) for i, name in enumerate(STAT_NAMES)}
        row["allreduce_s"] = reduce_seconds
        row["ranks_live"] = len(self.live)
        # Rank 0 folded its own uploads itself (a secure round: their unmasked sum, once); the others must have
        # folded what rank 0 counted for them.
        folded = {r: int(values[-1]) for r, values in stats.items()}
        if any(folded[r] != expected[r] for r in folded if r):
            raise RuntimeError(f"round {state.round_id}: the aggregator ranks folded {folded} updates where rank 0 "
                               f"counted {expected}")
        return row

    async def publish(self, round_id: int, weights: Sequence[np.ndarray] | None) -> None:
        """The round's end: the new global model to every rank, or None: the model stays as it was."""
        def work():
            self.group.send(pb.RankBroadcast(model=pb.RankModel(round=round_id, changed=weights is not None)))
            if weights is not None:
                self.group.broadcast_arrays(weights)
        while True:
            try:
                return await self._collective(work)
            except RanksChanged:  # the ranks left take the model again
                pass

    async def stop(self, finished: bool) -> None:
        """Stop ticking and have the other ranks stop serving, as after the last round: when every round is
        ``finished`` (sent again to the ranks left if one is lost meanwhile), and also when the run stops early (a
        signal: sent once, waiting at most STOP_SEND_SECONDS, so that they leave quietly instead of finding rank 0
        gone)."""
        for task in (self._ticker, self._watcher):
            if task is not None:
                task.cancel()
        while finished:
            try:
                await self._collective(self.group.send, pb.RankBroadcast(stop=pb.RankStop()))
                break
            except RanksChanged:
                pass
        if not finished and self._started and self._broken is None:
            try:  # behind the step a cancelled round left on the collective thread, if any: the ranks expect it
                await asyncio.wait_for(self._steps.run(self.group.send, pb.RankBroadcast(stop=pb.RankStop()),
                                                       lost=self._lost_now), STOP_SEND_SECONDS)
            except (RuntimeError, ValueError, TimeoutError) as exc:  # a rank is gone or hangs: its launcher stops it
                log.info("aggregator ranks: the other ranks were not told to stop (%s)", first_line(exc))
        if finished and self._broken is None:  # a replacement still asking to be taken back leaves
            try:
                await self._steps.run(self.group.stopped)
            except RankMissing as exc:  # the store is gone: so is anything that waited in it
                log.info("aggregator ranks: %s", exc)
        if self._control is not None:
            await self._control.stop(0.5)
        self._steps.close()
