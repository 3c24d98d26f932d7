"""The coordinator: runs rounds, hands out tasks, accepts validated updates, keeps the global model.

All state lives on one asyncio event loop; CPU-heavy work (folding, finishing, serializing,
checkpointing, evaluating) runs in a thread pool so the loop keeps serving gRPC calls.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from dataclasses import replace
from typing import Callable, Sequence

import grpc
import numpy as np

from fedpar.aggregation.strategy import accumulate_in
from fedpar.protocol.heap import trim_heap
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout
from fedpar.security.admission import Admission, AdmissionRefused
from fedpar.security.identity import PeerIdentity
from fedpar.server.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from fedpar.server.config import CoordinatorConfig
from fedpar.server.metrics import RoundMetricsLog, clean_row
from fedpar.server.ranks.group import RankMissing
from fedpar.server.ranks.leader import RankLeader
from fedpar.server.ranks.plane import IngestPlane
from fedpar.server.ranks.stats import STAT_NAMES, ingest_stats
from fedpar.server.registry import AgentRecord, AgentRegistry, AuthError, HostRecord, speaker
from fedpar.server.round_modes import RoundModes
from fedpar.server.rounds import UPLOAD_REFUSALS, AgentSlot, Refusal, RoundState, UploadTicket
from fedpar.server.sampler import CohortSampler
from fedpar.server.secure_round import SecureRound
from fedpar.server.virtual_clock import VirtualClock

log = logging.getLogger("fedpar.server")
EvaluateFn = Callable[[list[np.ndarray]], dict[str, float]]
RoundCallback = Callable[[dict], None]
HOST_WAKEUP = "\0host:"  # wakeup key prefix of a simulation host (agent ids are printable, so never clash)
MAX_HOSTED_TASKS = 512  # tasks in one PullHostTasks reply (a reply stays far below the message size limit)


class Coordinator(IngestPlane):
    """Round state machine plus the global model; the gRPC servicer calls into it. With aggregator ranks it is
    rank 0, the control plane, and ``ranks`` reaches the others."""

    def __init__(self, config: CoordinatorConfig, names: Sequence[str], weights: Sequence[np.ndarray],
                 strategy, evaluate_fn: EvaluateFn | None = None,
                 on_round_end: Sequence[RoundCallback] = (), admission: Admission | None = None,
                 ranks: RankLeader | None = None):
        config.validate()
        super().__init__(config, names, weights, AgentRegistry(config.liveness_timeout_seconds, admission=admission,
                                                              max_known=config.max_agents))
        self.strategy = strategy
        accumulate_in(strategy, config.fold_dtype, ranks.group.fold_device if ranks is not None else None)
        self.evaluate_fn = evaluate_fn
        self.on_round_end = list(on_round_end)
        self.sampler = CohortSampler(config.seed)
        self.modes = RoundModes(config, self.names, self.weights, strategy, self._executor)
        self.ranks = ranks  # the other aggregator ranks (server/ranks/), or None
        self._task_json = "{}"  # the current round's TaskSettings as every task carries them (extra_json)
        self.finished = False
        self._not_yet_told: set[str] = set()  # live agents (or their hosts) not yet told that training is over
        self.metrics = RoundMetricsLog(config.metrics_path, declared_columns(config), config.target_accuracy)
        self.started_at = time.monotonic()
        self._tasks: dict[str, AgentSlot] = {}  # undelivered task per agent
        self._wakeups: dict[str, asyncio.Event] = {}  # per agent, and per simulation host (HOST_WAKEUP + id)
        self._host_tasks: dict[str, set[str]] = {}  # per simulation host: its members dealt a task not yet sent
        self._host_go: dict[str, set[str]] = {}  # per simulation host: its members the virtual clock let go
        self.clock = VirtualClock() if config.virtual_clock else None
        self._agents_changed = asyncio.Event()  # binds to the loop that first waits on it (the serving loop)

    # ----------------------------------------------------------------- life cycle
    def restore(self) -> None:
        """Resume from the latest checkpoint in ``config.checkpoint_dir``, if any (CheckpointError/ValueError when
        it is damaged or of another model). The server calls it once its port answers health checks (NOT_SERVING
        meanwhile) and before any agent's call is served."""
        if self.config.checkpoint_dir is not None:
            self._resume(load_checkpoint(self.config.checkpoint_dir))

    def _resume(self, ckpt: Checkpoint | None) -> None:
        if ckpt is None:
            return
        layout = ModelLayout.of_arrays(ckpt.names, ckpt.arrays)
        problem = layout.mismatch(self.layout)
        if problem:
            raise ValueError(f"checkpoint in {self.config.checkpoint_dir} does not fit this model: {problem}; "
                             "point --checkpoint-dir elsewhere or use the model it was made with")
        self.weights = ckpt.arrays
        self.round_id = ckpt.round_id
        with ckpt.restoring("sampler"):
            self.sampler.load_state(ckpt.state["sampler"])
        with ckpt.restoring("strategy"):
            self.strategy.load_state_dict(ckpt.strategy_arrays, ckpt.state.get("strategy", {}))
        caps = "example_caps" if "example_caps" in ckpt.state else "agents"  # older checkpoints: a list of agents
        with ckpt.restoring(caps):
            self.registry.restore(ckpt.state.get(caps, {}))
        with ckpt.restoring("metrics_summary"):
            self.metrics.resume(self.round_id, ckpt.state.get("metrics_row"), ckpt.state.get("metrics_summary"))
        if self.clock is not None:
            with ckpt.restoring("clock_seconds"):
                self.clock.seconds = float(ckpt.state.get("clock_seconds", 0.0))
        log.info("resumed from checkpoint after round %d; the next round starts once %d agents have re-joined",
                 self.round_id, self.config.min_available)

    async def run(self) -> None:
        """Run rounds until ``config.rounds`` have completed, then tell agents to shut down."""
        await self._publish_payload(self.round_id + 1)
        if self.ranks is not None:
            await self.ranks.start(self)
        completed = stopped_early = False
        self._ready(True)
        try:
            while self.round_id < self.config.rounds:
                await self._wait_for_agents()
                await self._run_round(self.round_id + 1)
            completed = True
        except (asyncio.CancelledError, RankMissing):  # stopped early (a signal, a lost aggregator rank)
            stopped_early = True
            raise
        finally:
            self._ready(False)
            if self.ranks is not None:
                await self.ranks.stop(completed)
            # A coordinator stopped early leaves its agents polling (they re-join the restarted one by themselves);
            # after the last round, or an error, they hear that training is over.
            if not stopped_early:
                self._not_yet_told = {self._wakeup_key(a) for a in self.registry.live_ids()}
            self.finished = not stopped_early
            for event in self._wakeups.values():
                event.set()

    async def _wait_for_agents(self) -> None:
        deadline = None
        if self.config.wait_for_agents_seconds is not None:
            deadline = time.monotonic() + self.config.wait_for_agents_seconds
        while len(self.registry.live_ids()) < self.config.min_available:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self.registry.live_ids())} live agents after "
                                   f"{self.config.wait_for_agents_seconds}s; need min_available="
                                   f"{self.config.min_available}")
            self._agents_changed.clear()
            try:
                await asyncio.wait_for(self._agents_changed.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass

    # ----------------------------------------------------------------- one round
    async def _run_round(self, round_id: int) -> None:
        live = self.registry.live_ids()
        cohort = self.sampler.sample(live, self.config.cohort_size(len(live)))
        target, moved = self.config.round_target(len(live), len(cohort))
        slots = {a: AgentSlot(a, secrets.token_hex(8)) for a in cohort}
        if self.ranks is not None:
            self.ranks.deal(slots)
        # Under the virtual clock the deadline is simulated (server/virtual_clock.py); in real time it guards hosts.
        wall_limit = self.config.round_wall_seconds if self.clock is not None else self.config.deadline_seconds
        state = RoundState(round_id, target, self.config.min_reports, wall_limit, slots)
        if self.clock is not None:
            self.clock.open_round(state)
        if self.data_port is not None:  # tickets exist only for the data plane
            self.tickets.expire_rounds_before(round_id)
        await self._in_thread(self.strategy.begin_round, round_id, self.weights)
        self.mode = self.modes.for_round(round_id, cohort, self.registry, self.weights)
        self.mode.start(state)
        settings = self.mode.task_settings(self.strategy.client_config(round_id))
        self._task_json = replace(settings, evaluate=self.config.evaluates_in(round_id)).to_json()
        if self.ranks is not None:
            await self.ranks.open_round(state, self.registry)
        self.current = state
        for agent_id, slot in slots.items():
            self._tasks[agent_id] = slot
            self._wake(agent_id)
        log.info("round %d: sampled %d of %d live agents, target %d%s", round_id, len(cohort), len(live), target,
                 f" ({moved})" if moved else "")
        if self.clock is not None:
            await self._decide_by_virtual_clock(state)
        try:
            await asyncio.wait_for(state.closed_event.wait(), timeout=self._round_time_left(state))
        except asyncio.TimeoutError:
            state.close("deadline")
        for agent_id in slots:
            if self._tasks.get(agent_id) is slots[agent_id]:
                del self._tasks[agent_id]
        await self.mode.close(state, self.weights)
        rank_columns = dict(zip((f"r0_{name}" for name in STAT_NAMES), ingest_stats(state, 0)))  # one rank
        if self.ranks is not None:
            try:
                rank_columns = await self.ranks.close_round(state, self.strategy)
            except RankMissing:
                raise
            except RuntimeError as exc:
                state.fold_failed = True
                log.error("%s; the round fails and the model stays", exc)
        await self._finish_round(state, rank_columns)

    def _round_time_left(self, state: RoundState) -> float:
        """Real seconds left before the round closes: its deadline, or under the virtual clock its wall guard."""
        return max(0.0, state.started + state.deadline_seconds - time.monotonic())

    async def _decide_by_virtual_clock(self, state: RoundState) -> None:
        """Wait for the sampled members' finish times (half the wall guard at most), then let the first K within
        the deadline train (server/virtual_clock.py)."""
        await self.clock.wait_for_estimates(self.config.round_wall_seconds / 2)
        decision = self.clock.close_estimates(state, self.config.deadline_seconds)
        log.info("round %d: %d of %d sampled clients train (virtual clock: %s after %.1f simulated seconds)",
                 state.round_id, len(decision.chosen), state.sampled, decision.reason, decision.seconds)
        if not decision.chosen:
            state.close("deadline")
        for slot in decision.chosen:
            record = self.registry.get(slot.agent_id)
            if record is not None and record.host is not None:
                self._host_go.setdefault(record.host, set()).add(slot.agent_id)
                self._wakeups.setdefault(HOST_WAKEUP + record.host, asyncio.Event()).set()

    @property
    def secure(self) -> SecureRound | None:
        """The current round's secure aggregation, if it runs one (SecAggExchange calls go there)."""
        return self.mode if isinstance(self.mode, SecureRound) else None

    async def _finish_round(self, state: RoundState, rank_columns: dict[str, float]) -> None:
        status = "ok"
        strategy_metrics: dict[str, float] = {}
        if state.accepted >= state.min_reports and not state.fold_failed:
            new_weights, strategy_metrics = await self._in_thread(self.strategy.finish)
            new_weights = [np.ascontiguousarray(w) for w in new_weights]
            problem = ModelLayout.of_arrays(self.names, new_weights).mismatch(self.layout)
            if problem or not all(np.isfinite(w).all() for w in new_weights if w.dtype.kind == "f"):
                status = "failed"
                log.error("round %d: strategy produced an unusable model (%s); keeping the old one",
                          state.round_id, problem or "non-finite values")
            else:
                self.weights = new_weights
        else:
            status = "failed"
            await self._in_thread(self.strategy.abort_round)
            log.warning("round %d failed: %d accepted updates < min_reports=%d; global model unchanged",
                        state.round_id, state.accepted, state.min_reports)
        self.round_id = state.round_id
        row = {"round": state.round_id, "status": status, "sampled": state.sampled,
               "reported": state.accepted, "rejected": state.rejected, "late": state.late(),
               "examples": state.examples, "close_reason": state.close_reason,
               "cohort_digest": cohort_digest(state.slots)}
        row.update(_weighted_client_metrics(state.metrics))
        row.update(self.mode.metrics())
        self.mode = None
        row["upload_bytes"] = state.upload_bytes  # tensor bytes accepted this round, compressed or not
        row["download_bytes"] = state.download_bytes  # model bytes sent: inline in tasks and completed downloads
        row.update({f"refused_{reason}": n for reason, n in sorted(state.refused.items())})
        row.update(rank_columns)
        row.update({k: float(v) for k, v in strategy_metrics.items()})
        if self.clock is not None:
            row.update(self.clock.finish_round())
        if self.ranks is not None:
            await self.ranks.publish(state.round_id, self.weights if status == "ok" else None)
        if self.evaluate_fn is not None:
            row.update(await self._in_thread(self.evaluate_fn, self.weights))
        await self._publish_payload(self.round_id + 1)
        now = time.monotonic()
        row["round_seconds"] = now - state.started
        row["wall_seconds"] = now - self.started_at
        if self.config.checkpoint_dir is not None:
            # The registry and sampler belong to the loop: snapshot them here, write in a thread. The
            # checkpoint precedes the metrics line; a crash between the two is repaired on resume.
            loop_state = {"sampler": self.sampler.state(), "example_caps": self.registry.snapshot(),
                          "metrics_summary": self.metrics.summary_with(row)}
            if self.clock is not None:
                loop_state["clock_seconds"] = self.clock.seconds
            await self._in_thread(self._checkpoint, row, loop_state)
        self.metrics.append(row)
        for callback in self.on_round_end:
            callback(row)
        await self._in_thread(trim_heap)  # a round's freed buffers leave the process (benchmarks/soak_bench.py)

    def _checkpoint(self, row: dict, loop_state: dict) -> None:
        arrays, meta = self.strategy.state_dict()
        state = {**loop_state, "strategy": meta, "metrics_row": clean_row(row)}
        json.dumps(state)  # fail here, loudly, if any strategy metadata is not JSON
        save_checkpoint(self.config.checkpoint_dir,
                        Checkpoint(self.round_id, self.names, self.weights, dict(arrays), state))

    # ----------------------------------------------------------------- agent calls
    def join(self, agent_id: str, num_examples: int, capabilities: dict[str, str],
             peer: PeerIdentity | None = None, enrollment_token: str = "") -> AgentRecord:
        """Register an agent; raises Refusal on bad identity data or if the agent is not admitted."""
        if self.clock is not None:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          "this coordinator runs a virtual clock (--clock virtual): only simulation hosts take part")
        try:
            record = self.registry.join(agent_id, num_examples, capabilities, peer, enrollment_token,
                                        self.config.max_examples_per_agent)
        except ValueError as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except AdmissionRefused as exc:
            log.warning("refused to admit agent %r: %s", agent_id[:128], exc.message)
            raise Refusal(exc.code, exc.message) from None
        self._wakeups.setdefault(agent_id, asyncio.Event())
        self._forget_gone()
        self._agents_changed.set()
        return record

    def join_population(self, host_id: str, host_token: str, members: list[tuple[str, int, bool]],
                        peer: PeerIdentity | None = None, enrollment_token: str = "") -> tuple[HostRecord,
                                                                                             list[AgentRecord]]:
        """Register a simulation host's members (server/registry.py); a Refusal if this coordinator takes no
        populations, or on bad data."""
        if not self.config.accept_populations:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          "this coordinator hosts no simulated populations; start it with --accept-populations")
        if len(members) > self.config.max_population_join:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{len(members)} members in one JoinPopulation; send at most "
                          f"{self.config.max_population_join} per call")
        try:
            host, records = self.registry.join_population(host_id, host_token, members, peer, enrollment_token,
                                                          self.config.max_examples_per_agent)
        except ValueError as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except AuthError as exc:
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED, str(exc)) from None
        except AdmissionRefused as exc:
            raise Refusal(exc.code, exc.message) from None
        self._host_tasks.setdefault(host_id, set())
        self._forget_gone()
        self._agents_changed.set()
        return host, records

    def _forget_gone(self) -> None:
        """Drop the wake-up events and host queues of agents and hosts the registry no longer holds (they expired),
        once there are twice as many as it holds: amortized O(1) per join, bounded by the live ones."""
        if len(self._wakeups) + len(self._host_tasks) <= 2 * (len(self.registry) + self.registry.host_count) + 64:
            return
        def kept(key: str) -> bool:
            if key.startswith(HOST_WAKEUP):
                return self.registry.host(key[len(HOST_WAKEUP):]) is not None
            return self.registry.get(key) is not None
        self._wakeups = {k: e for k, e in self._wakeups.items() if kept(k)}
        self._host_tasks = {h: q for h, q in self._host_tasks.items() if self.registry.host(h) is not None}
        self._host_go = {h: q for h, q in self._host_go.items() if self.registry.host(h) is not None}

    def _wake(self, agent_id: str) -> None:
        record = self.registry.get(agent_id)
        if record is not None and record.host is not None:  # its host long-polls for it
            self._host_tasks.setdefault(record.host, set()).add(agent_id)
        self._wakeups.setdefault(self._wakeup_key(agent_id), asyncio.Event()).set()

    def _wakeup_key(self, agent_id: str) -> str:
        """Who long-polls for ``agent_id``: the agent itself, or HOST_WAKEUP + its host for a population member."""
        record = self.registry.get(agent_id)
        return HOST_WAKEUP + record.host if record is not None and record.host is not None else agent_id

    def everyone_told_finished(self) -> bool:
        """Whether training is over and every agent (or host) live at the end has been told so by a reply."""
        return self.finished and not self._not_yet_told

    async def next_host_tasks(self, host: HostRecord, wait_seconds: float, away: Sequence[str] = (),
                              back: Sequence[str] = (),
                              finish_estimates: Sequence[pb.FinishEstimate] = ()) -> pb.PullHostTasksReply:
        """The tasks of ``host``'s members sampled since its last call (and, under the virtual clock, those let go),
        waiting up to ``wait_seconds`` for some; ``away`` / ``back``: its members that went offline or came back (not
        sampled while away); ``finish_estimates``: its members' simulated finish times for their held tasks."""
        if away or back:
            self.registry.set_away(host.host_id, list(away), list(back))
            self._agents_changed.set()
        self._record_estimates(host, finish_estimates)
        deadline = time.monotonic() + max(0.0, min(wait_seconds, self.config.heartbeat_seconds))
        while True:
            if self.finished:
                self._not_yet_told.discard(HOST_WAKEUP + host.host_id)
                return pb.PullHostTasksReply(shutdown_reason=f"training finished after round {self.round_id}")
            pending = sorted(self._host_tasks.get(host.host_id, ()))
            self._host_tasks[host.host_id] = set(pending[MAX_HOSTED_TASKS:])  # the next call takes the rest
            out = pb.PullHostTasksReply()
            if self.clock is not None:
                out.go.extend(sorted(self._host_go.pop(host.host_id, ())))
                out.clock_seconds = self.clock.seconds
            for agent_id in pending[:MAX_HOSTED_TASKS]:
                record = self.registry.get(agent_id)
                reply = self._task_reply(record) if record is not None and record.host == host.host_id else None
                if reply is None or reply.WhichOneof("kind") != "task":
                    continue
                task = reply.task
                if task.weights:  # one copy of a small model for the whole reply, not one per task
                    out.weights_header.CopyFrom(task.weights_header)
                    out.weights = task.weights
                    task.ClearField("weights_header")
                    task.ClearField("weights")
                out.tasks.append(pb.HostedTask(agent_id=agent_id, task=task))
            if out.tasks or out.go or not await self._wait_for_wakeup(HOST_WAKEUP + host.host_id, deadline):
                return out
            host.last_seen = time.monotonic()

    def _record_estimates(self, host: HostRecord, estimates: Sequence[pb.FinishEstimate]) -> None:
        """Hand the virtual clock ``host``'s finish estimates; a Refusal for another host's member or when there
        is no virtual clock."""
        if not estimates:
            return
        if self.clock is None:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          "finish estimates sent, but this coordinator runs in real time (no --clock virtual)")
        for estimate in estimates:
            record = self.registry.get(estimate.agent_id)
            if record is None or record.host != host.host_id:
                raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                              f"{estimate.agent_id[:128]!r} is not a member of host {host.host_id!r}")
            self.clock.record(self.current, estimate.agent_id, estimate.task_id, estimate.seconds)

    async def next_task(self, agent: AgentRecord, wait_seconds: float,
                        finished_task_id: str = "") -> pb.PullTaskReply:
        """A task for ``agent`` if it has one, waiting up to ``wait_seconds`` for one to appear
        (``finished_task_id``: the task the agent says it is done with, never handed out again)."""
        deadline = time.monotonic() + max(0.0, min(wait_seconds, self.config.heartbeat_seconds))
        while True:
            reply = self._task_reply(agent, finished_task_id)
            if reply is not None:
                return reply
            if not await self._wait_for_wakeup(agent.agent_id, deadline):
                return pb.PullTaskReply(wait_seconds=0.0)
            agent.last_seen = time.monotonic()

    async def _wait_for_wakeup(self, key: str, deadline: float) -> bool:
        """A long-poll's wait: until ``key`` (an agent, or HOST_WAKEUP + a host) is woken or ``deadline``
        passes; False if the time was up already."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        event = self._wakeups.setdefault(key, asyncio.Event())
        event.clear()
        try:
            await asyncio.wait_for(event.wait(), timeout=remaining)
        except asyncio.TimeoutError:
            pass
        return True

    def _task_reply(self, agent: AgentRecord, finished_task_id: str = "") -> pb.PullTaskReply | None:
        if self.finished:
            self._not_yet_told.discard(agent.agent_id)
            return pb.PullTaskReply(shutdown_reason=f"training finished after round {self.round_id}")
        state = self.current
        if state is None or state.closed:
            return None
        slot = self._tasks.pop(agent.agent_id, None) or self._redeliverable(state, agent.agent_id, finished_task_id)
        if slot is None:
            return None
        slot.dispatched = True
        task = pb.TrainTask(round=state.round_id, task_id=slot.task_id, deadline_seconds=self._round_time_left(state),
                            local_epochs=self.config.local_epochs, batch_size=self.config.batch_size,
                            learning_rate=self.config.learning_rate, extra_json=self._task_json,
                            model_bytes=self.layout.total_bytes)
        if self.clock is not None:
            task.virtual_clock, task.clock_seconds = True, self.clock.seconds
            task.clock_deadline_seconds = self.config.deadline_seconds
        payload = self.payload
        if payload is not None and payload.inline is not None and payload.round_id == state.round_id:
            task.weights_header.MergeFromString(payload.model_header)
            task.weights = payload.inline
            state.download_bytes += len(payload.inline)
        if slot.rank:  # another aggregator rank takes this agent's download and upload
            self.ranks.route(task, slot)
        elif self.data_port is not None:
            task.data_port = self.data_port
            if slot.data_ticket is None:
                slot.data_ticket = self.tickets.issue(agent.agent_id, state.round_id, slot.task_id, speaker(agent))
            task.data_ticket = slot.data_ticket
        return pb.PullTaskReply(task=task)

    def _redeliverable(self, state: RoundState, agent_id: str, finished_task_id: str = "") -> AgentSlot | None:
        """The task of an agent that pulls again before any download of it completed (the task reply or the
        download was lost on the way), so a lost message does not cost the agent its round; never the task
        the agent says it finished with. Secure rounds are excluded: their key exchange cannot be replayed."""
        slot = state.slots.get(agent_id)
        if slot is None or not slot.dispatched or slot.downloaded or slot.status != "pending" \
                or not self.mode.redelivers_tasks or slot.task_id == finished_task_id:
            return None
        return slot

    def download_completed(self, agent_id: str, round_id: int, task_id: str) -> None:
        """Note that ``agent_id`` received the whole model of its task (its task is no longer re-delivered)."""
        state = self.current
        if state is not None and state.round_id == round_id:
            slot = state.slots.get(agent_id)
            if slot is not None and slot.task_id == task_id:
                slot.downloaded = True
                state.download_bytes += self.layout.total_bytes

    async def accept(self, ticket: UploadTicket, arrays: list[np.ndarray]) -> None:
        """Fold a complete, validated update into the round (raises Refusal if the round closed)."""
        state, slot = ticket.state, ticket.slot
        arrays = await ticket.mode.decoded(self.weights, arrays)  # refused here if the content is invalid
        state.refuse_if_closed(slot)
        await ticket.mode.accept(state, ticket, arrays)

    def leave(self, agent: AgentRecord) -> None:
        """Agent says goodbye."""
        self.registry.leave(agent.agent_id)


def declared_columns(config: CoordinatorConfig) -> list[str]:
    """The metrics columns this configuration's rows may bring after the first (those every row has come with it):
    metrics.csv declares them up front so a later row does not widen it (server/metrics.py)."""
    columns = [f"refused_{code}" for code in UPLOAD_REFUSALS]
    if config.client_eval_every > 0:  # rounds with federated evaluation (our trainer's names; a task's come once)
        columns += ["federated_eval_loss", "federated_eval_accuracy"]
    if config.secure_aggregation:  # only some rounds have them
        columns += ["secagg_dropped", "secagg_error_bound", "secagg_failure"]
    return columns


def cohort_digest(agent_ids) -> str:
    """A short fingerprint of a cohort (sorted ids), so runs can be compared round by round."""
    return hashlib.sha256("\n".join(sorted(agent_ids)).encode()).hexdigest()[:16]


def _weighted_client_metrics(reports: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Example-weighted means of what agents reported (train loss, federated evaluation)."""
    out: dict[str, float] = {}
    named = sorted({k for _, m in reports for k in m})
    for key in (k for k in named if k.startswith("train_") and k != "train_seconds"):  # train_loss, a task's own
        train = [(n, m[key]) for n, m in reports if key in m]
        if train and sum(n for n, _ in train):
            out[key] = sum(n * v for n, v in train) / sum(n for n, _ in train)
    evals = [(m["eval_examples"], m) for _, m in reports if m.get("eval_examples", 0) > 0]
    for key in (k for k in named if k.startswith("eval_") and k != "eval_examples"):  # eval_loss, eval_accuracy, ...
        vals = [(n, m[key]) for n, m in evals if key in m]
        if vals:
            out[f"federated_{key}"] = sum(n * v for n, v in vals) / sum(n for n, _ in vals)
    return out
