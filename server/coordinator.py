"""The coordinator: runs rounds, hands out tasks, accepts validated updates, keeps the global model.

All state lives on one asyncio event loop; CPU-heavy work (folding, finishing, serializing,
checkpointing, evaluating) runs in a thread pool so the loop keeps serving gRPC calls.

The clock its rounds run on: real time in production (:class:`WallClock`), simulated time in a simulated federation
(server/virtual_clock.py). The coordinator is given one and calls it only through :class:`RoundClock`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import secrets
import time
from dataclasses import replace
from typing import Callable, Protocol, Sequence

import grpc
import numpy as np

from fedpar.protocol.heap import round_counters, trim_heap
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout
from fedpar.protocol.run_logs import RoundMetricsLog, another_runs_rows, clean_row
from fedpar.protocol.task_settings import TaskSettings
from fedpar.wording import counted
from fedpar.security.admission import Admission
from fedpar.server.checkpoint import (Checkpoint, CheckpointError, load_checkpoint, other_runs_refusal,
                                     save_checkpoint, strategy_refusal)
from fedpar.server.config import CoordinatorConfig
from fedpar.server.deadline import (DEADLINE, cohort_size, round_target, seconds_left, target_reports,
                                    until_closed, wall_seconds)
from fedpar.server.ranks.group import RankMissing
from fedpar.server.ranks.leader import RankLeader
from fedpar.server.ranks.plane import IngestPlane
from fedpar.server.members import CohortSampler, Members
from fedpar.server.populations import member_source
from fedpar.server.registry import AgentRecord, AgentRegistry, checked_caps, speaker
from fedpar.server.round_modes import RoundModes
from fedpar.server.rounds import REOPENABLE, STAT_NAMES, UPLOAD_REFUSALS, AgentSlot, Refusal, RoundState, ingest_stats
from fedpar.server.uploads import per_update
from fedpar.server.secure_round import SecureRound
from fedpar.server.virtual_clock import VirtualClock

log = logging.getLogger("fedpar.server")
TRIM_SECONDS = 1.0  # the least time between two heap trims (rounds shorter than this share one)
MAX_FAILURE_CHARS = 500  # of an agent's reason for a failed task, as the round's row keeps it
# distinct names of agents' reported metrics a run's rows take as columns: an agent naming new ones every round would
# otherwise widen metrics.csv (and so rewrite it whole) every round of the run
MAX_CLIENT_METRICS = 64
# a central evaluation that took less runs on the loop the next round, once that round's tasks went out: on a busy
# machine waking a worker thread for it costs about as much
LOOP_EVALUATION_SECONDS = 0.005
EvaluateFn = Callable[[list[np.ndarray]], dict[str, float]]
RoundCallback = Callable[[dict], None]


class LetGo(Protocol):
    """Whom a clock tells that held tasks may go ahead (the member source: server/members.py)."""

    def let_go(self, agent_ids: Sequence[str]) -> None:
        """The members of ``agent_ids`` may now download, train and upload."""


class RoundClock(Protocol):
    """What a round asks of its clock (every method runs on the coordinator's event loop)."""

    idle_steps: int  # times it moved on between rounds, while too few members were online
    wall_reason: str  # why a round closes when its real seconds (server/deadline.py wall_seconds) pass

    def open_round(self, state: RoundState) -> None:
        """The round's tasks are about to go out."""

    async def choose(self, state: RoundState, members: LetGo) -> None:
        """Once the tasks are out, decide who of the sampled trains (and tell ``members``)."""

    def record(self, state: RoundState | None, agent_id: str, task_id: str, seconds: float) -> None:
        """One member's reported finish time for its held task."""

    def stamp(self, task: pb.TrainTask) -> None:
        """Add the clock's fields to a task handed out."""

    def stamp_reply(self, reply: pb.PullHostTasksReply) -> None:
        """Add the clock's fields to a simulation host's reply."""

    async def wait_for_live(self, members: Members, count: int, wait_seconds: float | None) -> None:
        """Until ``count`` members are online (TimeoutError after ``wait_seconds``; None: no limit)."""

    def finish_round(self, state: RoundState) -> dict:
        """The round ``state`` ended: the clock's columns of its metrics row."""

    def state(self) -> dict:
        """The clock's entries of the checkpoint (JSON)."""

    def restore(self, state: dict) -> None:
        """Take the clock's entries of a checkpoint's state (ValueError/TypeError if damaged)."""


class WallClock:
    """Real time: every sampled agent trains; the straggler deadline is in real seconds (server/deadline.py)."""

    idle_steps = 0  # real time moves by itself
    wall_reason = DEADLINE  # the round's real seconds are its straggler deadline

    def open_round(self, state: RoundState) -> None:
        """Nothing is held in real time."""

    async def choose(self, state: RoundState, members: LetGo) -> None:
        """Every sampled agent trains."""

    def record(self, state: RoundState | None, agent_id: str, task_id: str, seconds: float) -> None:
        """A Refusal: only a virtual clock takes finish times."""
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                      "finish estimates sent, but this coordinator runs in real time (no --clock virtual)")

    def stamp(self, task: pb.TrainTask) -> None:
        """A real-time task carries only its deadline."""

    def stamp_reply(self, reply: pb.PullHostTasksReply) -> None:
        """Nothing to add in real time."""

    async def wait_for_live(self, members: Members, count: int, wait_seconds: float | None) -> None:
        """Until ``count`` members are live, as they join or come back."""
        await members.wait_for_live(count, wait_seconds)

    def finish_round(self, state: RoundState) -> dict:
        """No columns in real time."""
        return {}

    def state(self) -> dict:
        """Nothing to checkpoint."""
        return {}

    def restore(self, state: dict) -> None:
        """Nothing to restore."""


def clock_for(config: CoordinatorConfig) -> RoundClock:
    """The clock ``config`` asks for (``--clock``)."""
    if config.virtual_clock:
        return VirtualClock(config.deadline_seconds, config.round_wall_seconds)
    return WallClock()


class Coordinator(IngestPlane):
    """Round state machine plus the global model; the gRPC servicer calls into it. It is given a clock (real or
    virtual: server/virtual_clock.py) and a member source (agents that joined, or hosts' populations:
    server/members.py); by default the ones ``config`` asks for. With aggregator ranks it is rank 0, the control plane,
    and ``ranks`` reaches the others."""

    def __init__(self, config: CoordinatorConfig, names: Sequence[str], weights: Sequence[np.ndarray],
                 strategy, evaluate_fn: EvaluateFn | None = None,
                 on_round_end: Sequence[RoundCallback] = (), admission: Admission | None = None,
                 ranks: RankLeader | None = None, clock: RoundClock | None = None, members: Members | None = None):
        config.validate()
        if members is None:
            members = member_source(config, AgentRegistry(config.liveness_timeout_seconds, admission=admission,
                                                          max_known=config.max_agents))
        super().__init__(config, names, weights, members.registry)
        self.members = members
        self.clock = clock if clock is not None else clock_for(config)
        self.strategy = strategy
        strategy.accumulate_in(config.fold_dtype, ranks.group.fold_device if ranks is not None else None)
        self.evaluate_fn = evaluate_fn
        self.on_round_end = [*on_round_end, *round_counters()]  # the heap traces' only if one was asked for
        self.on_restored: list[Callable[[], None]] = []  # called once restore() took the checkpoint (or found none)
        self.sampler = CohortSampler(config.seed)
        self.modes = RoundModes(config, self.names, self.weights, strategy, self._executor)
        self.ranks = ranks  # the other aggregator ranks (server/ranks/), or None
        # the current round's TaskSettings as every task carries them (extra_json)
        self._task_json = TaskSettings(run_config=config.flower_run_config).to_json()
        self.finished = False
        self.keeps_members = False  # a service's next run takes the members: they never hear that training is over
        self.metrics = RoundMetricsLog(config.metrics_path, declared_columns(config), config.target_accuracy)
        self.started_at = time.monotonic()
        self.earlier_seconds = 0.0  # a resumed run's wall seconds up to its checkpointed round, in earlier processes
        self.client_metric_names: set[str] = set()  # the reported metrics the rows take (MAX_CLIENT_METRICS)
        self.client_metrics_full = False  # said that a reported metric was left out
        self._trimmed_at = -TRIM_SECONDS  # the first round's end trims
        self._tasks: dict[str, AgentSlot] = {}  # undelivered task per agent
        self._evaluation_seconds = math.inf  # how long the last central evaluation took (the first: on a thread)
        self._behind: asyncio.Future | None = None  # the last finished round's evaluation, checkpoint and metrics line
        self._example_caps: dict[str, int] = {}  # the checkpoint's, taken with the agents' calls (taking_calls)
        self._needs_task: tuple[str, Callable[[str, str], None]] | None = None  # see sample_only
        self._target_said = ""  # what last moved a round's K (round_target), said once rather than every round
        self._short_said = False  # whether a round with fewer live agents than K was said (once a run)
        members.on_restart = self._restarted

    # ----------------------------------------------------------------- life cycle
    def restore(self) -> None:
        """Resume from the latest checkpoint in ``config.checkpoint_dir``, if any (CheckpointError/ValueError when
        it is damaged or of another model). The server calls it on a worker thread before the agents' calls come
        here (its port answers health checks, NOT_SERVING, or the coordinator beneath answers them), so it leaves
        the registry, which the port's coordinators may share, to :meth:`taking_calls`."""
        if self.config.checkpoint_dir is not None:
            self._resume(load_checkpoint(self.config.checkpoint_dir))
        for restored in self.on_restored:
            restored()

    def sample_only(self, task: str, on_lacking: Callable[[str, str], None]) -> None:
        """Sample only the members that declared ``task`` (a service's run), from when the agents' calls come here;
        ``on_lacking(agent_id, why)`` names each other one once (Members.require_task)."""
        self._needs_task = (task, on_lacking)

    def taking_calls(self) -> None:
        """The agents' calls come here from now on (on the loop): the run's example caps start, from the
        checkpoint's when it resumed (a service's agents stay joined across runs, their caps do not), and so does
        the task it samples by (:meth:`sample_only`)."""
        super().taking_calls()
        self.registry.restore(self._example_caps)
        if self._needs_task is not None:
            self.members.require_task(*self._needs_task)

    def hand_over(self) -> None:
        """Another coordinator takes the agents' calls: this one's long-polls end at once."""
        super().hand_over()
        self.members.wake_all()

    def _resume(self, ckpt: Checkpoint | None) -> None:
        if ckpt is None:
            return
        layout = ModelLayout.of_arrays(ckpt.names, ckpt.arrays)
        problem = layout.mismatch(self.layout)
        if problem:
            raise ValueError(f"checkpoint in {self.config.checkpoint_dir} does not fit this model: {problem}; "
                             "point --checkpoint-dir elsewhere or use the model it was made with")
        saved = ckpt.state.get("strategy")
        saved_by = saved.get("strategy") if isinstance(saved, dict) else None
        if saved_by is not None and saved_by != self.strategy.name:  # not damaged: made by another command line
            raise CheckpointError(strategy_refusal(self.config.checkpoint_dir, saved_by, self.strategy.name))
        self.weights = ckpt.arrays
        self.round_id = ckpt.round_id
        with ckpt.restoring("sampler"):
            self.sampler.load_state(ckpt.state["sampler"])
        with ckpt.restoring("strategy"):
            self.strategy.load_state_dict(ckpt.strategy_arrays, ckpt.state.get("strategy", {}))
        caps = "example_caps" if "example_caps" in ckpt.state else "agents"  # older checkpoints: a list of agents
        with ckpt.restoring(caps):
            self._example_caps = checked_caps(ckpt.state.get(caps, {}))
        if self.metrics.path is not None:
            other = another_runs_rows(self.metrics.path, self.round_id, ckpt.state.get("metrics_row"))
            if other:
                raise CheckpointError(other_runs_refusal(self.metrics.path, other, self.config.checkpoint_dir))
        with ckpt.restoring("metrics_summary"):
            earlier = ckpt.state.get("metrics_path")
            if not self.metrics.resume(self.round_id, ckpt.state.get("metrics_row"), ckpt.state.get("metrics_summary"),
                                       earlier):
                log.warning("the rows of the rounds before round %d were written to %s, which is gone or holds "
                            "another run's rows now: %s starts at round %d", self.round_id, earlier, self.metrics.path,
                            self.round_id)
        earlier = (self.metrics.last or {}).get("wall_seconds")
        if isinstance(earlier, (int, float)) and 0 <= earlier < math.inf:  # rows go on counting the whole run's time
            self.earlier_seconds = float(earlier)
            self.started_at -= self.earlier_seconds
        with ckpt.restoring("clock"):
            self.clock.restore(ckpt.state)
        if self.round_id >= self.config.rounds:
            log.info("resumed from checkpoint after round %d: every one of the %d rounds is done already (give more "
                     "rounds to train on)", self.round_id, self.config.rounds)
        else:
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
                await self.clock.wait_for_live(self.members, self.config.min_available,
                                               self.config.wait_for_agents_seconds)
                await self._run_round(self.round_id + 1)
            await self._caught_up()
            completed = True
        # Stopped early (a signal, a lost aggregator rank, a checkpoint or metrics file it could not write): the same
        # command resumes.
        except (asyncio.CancelledError, RankMissing, OSError):
            stopped_early = True
            raise
        finally:
            if self._behind is not None:  # stopped early: the last finished round is still written, if it can be
                try:
                    await self._caught_up()
                except OSError as exc:
                    log.warning("round %d was not written: %s", self.round_id, exc)
            self._ready(False)
            if self.ranks is not None:
                await self.ranks.stop(completed)
            # A coordinator stopped early leaves its agents polling (they re-join the restarted one by themselves);
            # after the last round, or an error, they hear that training is over.
            self.finished = not stopped_early
            self.members.finish(tell=not stopped_early and not self.keeps_members)

    # ----------------------------------------------------------------- one round
    async def _run_round(self, round_id: int) -> None:
        live = self.members.live_ids()
        cohort = self.sampler.sample(live, cohort_size(self.config, len(live)))
        target, moved = round_target(self.config, len(live), len(cohort))
        slots = {a: AgentSlot(a, secrets.token_hex(8)) for a in cohort}
        if self.ranks is not None:
            self.ranks.deal(slots)
        state = RoundState(round_id, target, self.config.min_reports, wall_seconds(self.config), slots,
                           counts_after=self._behind)
        self.clock.open_round(state)
        if self.data_port is not None:  # tickets exist only for the data plane
            self.tickets.expire_rounds_before(round_id)
        await self._model_work(self.strategy.begin_round, round_id, self.weights)
        self.mode = self.modes.for_round(round_id, cohort, self.registry, self.weights)
        self.mode.start(state)
        settings = self.mode.task_settings(self.strategy.client_config(round_id))
        self._task_json = replace(settings, evaluate=self.config.evaluates_in(round_id),
                                  run_config=self.config.flower_run_config).to_json()
        if self.ranks is not None:
            await self.ranks.open_round(state, self.registry)
        self.current = state
        self._tasks.update(slots)
        self.members.deal(list(slots))
        log.info("round %d: sampled %d of %d live agents, target %d%s", round_id, len(cohort), len(live), target,
                 f" ({moved})" if moved and moved != self._target_said else "")
        self._target_said = moved
        if len(cohort) < target_reports(self.config, len(live)) and not self._short_said:
            self._short_said = True  # a trace's quiet hours make it every night: said once, the rows count it
            log.warning("round %d: %s live to sample, fewer than the %d a round asks for: rounds go on with those "
                        "there are (each row's 'sampled' says how many)", round_id, counted(len(cohort), "agent"),
                        target_reports(self.config, len(live)))
        await self.clock.choose(state, self.members)
        if state.counts_after is not None and not state.counts_after.done():
            # the deadline does not run while the round may not count updates (the last round is being written)
            waiting = time.monotonic()
            await asyncio.wait([state.counts_after])
            state.deadline_seconds += time.monotonic() - waiting
        if not await until_closed(state, state.closed_event, lambda: state.lose(self._silent(state))):
            state.close(self.clock.wall_reason)
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
                state.fail(str(exc))
                log.error("%s; the round fails and the model stays", exc)
        await self._finish_round(state, rank_columns)

    def _silent(self, state: RoundState) -> list[str]:
        """The round's sampled agents yet to answer that the registry let go (their liveness ran out, or they left)."""
        pending = [a for a, slot in state.slots.items() if slot.status == "pending"]
        if not pending or self.secure is not None:  # a secure round's dropouts are its protocol's (it unmasks them)
            return []
        self.registry.expire()
        return [a for a, record in zip(pending, self.registry.get_many(pending)) if record is None or record.left]

    @property
    def secure(self) -> SecureRound | None:
        """The current round's secure aggregation, if it runs one (SecAggExchange calls go there)."""
        return self.mode if isinstance(self.mode, SecureRound) else None

    async def _finish_round(self, state: RoundState, rank_columns: dict[str, float]) -> None:
        await self._caught_up()
        status = "ok"
        strategy_metrics: dict[str, float] = {}
        failure = state.failed_because()
        if not failure:
            # a linear strategy's finish is a pass over its running sum (the model's size); the others' grows with
            # the updates they hold: always on a worker thread
            finish = self._model_work if self.strategy.linear else self._in_thread
            new_weights, strategy_metrics = await finish(self.strategy.finish)
            new_weights = [np.ascontiguousarray(w) for w in new_weights]
            problem = ModelLayout.of_arrays(self.names, new_weights).mismatch(self.layout)
            if problem or not all(np.isfinite(w).all() for w in new_weights if w.dtype.kind == "f"):
                status = "failed"
                failure = f"the strategy produced an unusable model ({problem or 'non-finite values'})"
                log.error("round %d: %s; keeping the old one", state.round_id, failure)
            else:
                self.weights = new_weights
        else:
            status = "failed"
            await self._model_work(self.strategy.abort_round)
            failures = f" ({state.training_failures} of {state.sampled} sampled agents failed their task)" \
                if state.training_failures else ""
            log.warning("round %d failed: %s%s; global model unchanged", state.round_id, failure, failures)
        if state.refused_updates > 1:  # each one after the round's first was logged at debug level (RoundState.reject)
            log.warning("round %d: %d updates refused in all (the first: %s)", state.round_id, state.refused_updates,
                        state.refusal)
        if status == "ok" and state.training_failures:  # (a failed run's last line names the error, once)
            log.warning("round %d: %d of %d sampled agents failed their task: %s", state.round_id,
                        state.training_failures, state.sampled, state.training_error)
        self.round_id = state.round_id
        row = {"round": state.round_id, "status": status, "sampled": state.sampled,
               "reported": state.accepted, "rejected": state.rejected, "late": state.late(),
               "silent": 0, "not_needed": 0, "examples": state.examples, "close_reason": state.close_reason,
               "cohort_digest": cohort_digest(state.slots)}
        if state.examples is None:  # hidden (a secure round under DP): no figure rather than the agents' count
            del row["examples"]
        if failure:
            row["failure"] = failure
        if state.training_error:
            row["training_error"] = state.training_error
        elif status != "ok" and state.refusal and not state.accepted:  # why a run whose every update was refused
            row["refused_because"] = state.refusal                       # failed (cli/user_errors.py)
        row.update(self._client_metrics(state.metrics))
        evaluated = [m for _, m in state.metrics if m.get("eval_examples", 0) > 0]
        strategy_eval = await self._model_work(self.strategy.aggregate_evaluation, evaluated) if evaluated else None
        if strategy_eval is not None:  # the strategy's, in place of the weighted means
            row = {k: v for k, v in row.items() if not k.startswith("federated_eval_")} | strategy_eval
        row.update(self.mode.metrics())
        self.mode = None
        row["upload_bytes"] = state.upload_bytes  # tensor bytes accepted this round, compressed or not
        row["download_bytes"] = state.download_bytes  # model bytes sent: inline in tasks and completed downloads
        row.update({f"refused_{reason}": n for reason, n in sorted(state.refused.items())})
        row.update(rank_columns)
        row.update({k: float(v) for k, v in strategy_metrics.items()})
        row.update(self.clock.finish_round(state))
        row.update(state.unanswered(row["close_reason"]))
        if self.ranks is not None:
            await self.ranks.publish(state.round_id, self.weights if status == "ok" else None)
        await self._publish_payload(self.round_id + 1)
        now = time.monotonic()
        row["round_seconds"] = now - state.started  # to the new model, ready for the next round's tasks
        row["wall_seconds"] = now - self.started_at
        # What the checkpoint holds of the state the next round changes is taken now; the rest waits for the row.
        taken = None
        if self.config.checkpoint_dir is not None:
            arrays, meta = await self._model_work(self.strategy.state_dict)
            taken = (dict(arrays), {"sampler": self.sampler.state(), "example_caps": self.registry.snapshot(),
                                    **self.clock.state(), "strategy": meta})
        written = self._round_written(state.round_id, row, self.weights, taken)
        if self.ranks is not None:  # the other ranks count uploads without asking whether it is written
            await written
        else:  # evaluated and written while the next round's tasks go out and its members train; it counts no update
            self._behind = asyncio.ensure_future(written)  # before
        # freed buffers leave the process (benchmarks/soak.py), beside the next round's opening; at most once per
        # TRIM_SECONDS: a full collection and a trim cost the loop about a millisecond, a short round's tenth. The
        # last round has no next one to go beside: the run's end frees what it frees.
        if now - self._trimmed_at >= TRIM_SECONDS and state.round_id < self.config.rounds:
            self._trimmed_at = now
            asyncio.get_running_loop().run_in_executor(self._executor, trim_heap)

    def _evaluate(self, weights: list[np.ndarray]) -> dict[str, float]:
        """The central evaluation of ``weights``, noting how long it took (a short one runs on the loop next time)."""
        started = time.perf_counter()
        try:
            return self.evaluate_fn(weights)
        finally:
            self._evaluation_seconds = time.perf_counter() - started

    async def _round_written(self, round_id: int, row: dict, weights: list[np.ndarray],
                             taken: tuple[dict, dict] | None) -> None:
        """A finished round's central evaluation of its ``weights`` (after the next round's tasks went out) and, with
        the state ``taken`` for it, its checkpoint on a worker thread, then its metrics line and callbacks; a crash
        between the checkpoint and the line is repaired on resume."""
        if self.evaluate_fn is not None and self._evaluation_seconds < LOOP_EVALUATION_SECONDS:
            await asyncio.sleep(0)  # the long-polls woken by the next round's deal reply first (each wakes in one turn)
            row.update(self._evaluate(weights))
        elif self.evaluate_fn is not None:
            row.update(await self._in_thread(self._evaluate, weights))
        if taken is not None:
            arrays, loop_state = taken
            loop_state.update(metrics_summary=self.metrics.summary_with(row), metrics_row=clean_row(row),
                              metrics_path=str(self.metrics.path.resolve()) if self.metrics.path else None)
            await self._in_thread(self._checkpoint, Checkpoint(round_id, self.names, weights, arrays, loop_state))
        self.metrics.append(row)
        for callback in self.on_round_end:
            callback(row)

    def _client_metrics(self, reports: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
        """The round's weighted means of the agents' reported metrics, of the first MAX_CLIENT_METRICS names the run's
        rows took (a name beyond them is left out, said once)."""
        means = _weighted_client_metrics(reports)
        names = self.client_metric_names
        fresh = [k for k in means if k not in names]
        room = MAX_CLIENT_METRICS - len(names)
        if len(fresh) > room and not self.client_metrics_full:
            self.client_metrics_full = True
            log.warning("agents reported more than %d distinct metrics in this run; the rows leave out %s and any "
                        "later new one", MAX_CLIENT_METRICS, ", ".join(fresh[room:room + 3]))
        names.update(fresh[:room])
        return {k: v for k, v in means.items() if k in names}

    async def _caught_up(self) -> None:
        """Wait until the last finished round's checkpoint and metrics line are written (raising what that raised: an
        OSError for a file that could not be written); a cancel here leaves the writing going."""
        behind, self._behind = self._behind, None
        if behind is not None:
            await asyncio.shield(behind)

    async def _model_work(self, fn, *args):
        """``fn(*args)``, work of the round's that grows with the model: on the loop for a small model (a thread's
        round trip costs more than the work), else on a worker thread, as an update's own work is run."""
        return await per_update(self.layout.total_bytes, fn, *args, executor=self._executor)

    def _checkpoint(self, checkpoint: Checkpoint) -> None:
        json.dumps(checkpoint.state)  # fail here, loudly, if any strategy metadata is not JSON
        save_checkpoint(self.config.checkpoint_dir, checkpoint)

    # ----------------------------------------------------------------- agent calls
    def everyone_told_finished(self) -> bool:
        """Whether training is over and every agent (or host) live at the end has been told so by a reply."""
        return self.finished and self.members.everyone_told()

    async def next_task(self, agent: AgentRecord, wait_seconds: float,
                        finished_task_id: str = "", failure: str = "") -> pb.PullTaskReply:
        """A task for ``agent`` if it has one, waiting up to ``wait_seconds`` for one to appear
        (``finished_task_id``: the task the agent says it is done with, never handed out again; ``failure``: why
        its own code failed that task, see :meth:`task_failed`)."""
        if failure:
            self.task_failed(agent.agent_id, finished_task_id, failure)
        deadline = time.monotonic() + max(0.0, min(wait_seconds, self.config.heartbeat_seconds))
        while True:
            reply = self.task_for(agent, finished_task_id)
            if reply is not None:
                return reply
            if self.handed_over or not await self.members.wait(agent.agent_id, deadline):
                return pb.PullTaskReply(wait_seconds=0.0)
            agent.last_seen = time.monotonic()

    def task_failed(self, agent_id: str, task_id: str, reason: str) -> None:
        """``agent_id``'s own code failed its task ``task_id`` of the open round (its training raised: ``reason``,
        one line): it answered with no update, so the round need not wait out its deadline for it. A task of
        another round, or one that sent an update already, is left as it is."""
        state = self.current
        slot = state.slots.get(agent_id) if state is not None and not state.closed else None
        if slot is not None and slot.task_id == task_id and slot.status == "pending":
            # an agent's words reach logs and terminals: one line, printable characters only
            line = "".join(c if c.isprintable() else "?" for c in " ".join(reason.split())[:MAX_FAILURE_CHARS])
            state.training_failed(slot, line)

    def finished_reason(self) -> str:
        """The one line a member hears when training is over."""
        return f"training finished after round {self.round_id}"

    def task_for(self, agent: AgentRecord, finished_task_id: str = "",
                 with_weights: bool = True) -> pb.PullTaskReply | None:
        """The reply to a poll of ``agent`` now: its task, or that training is over; None while it has none.
        ``with_weights=False``: a small model is left out of the task (a host's reply carries it once, see
        :meth:`inline_weights`), though still counted as sent."""
        if self.finished and not self.keeps_members:
            self.members.told(agent.agent_id)
            return pb.PullTaskReply(shutdown_reason=self.finished_reason())
        state = self.current
        if state is None or state.closed:
            return None
        slot = self._tasks.pop(agent.agent_id, None)
        if slot is not None and (slot.status != "pending" or slot.task_id == finished_task_id):
            slot = None  # handed again to a process started anew, but answered meanwhile
        slot = slot or self._redeliverable(state, agent.agent_id, finished_task_id)
        if slot is None:
            return None
        slot.dispatched = True
        task = pb.TrainTask(round=state.round_id, task_id=slot.task_id, deadline_seconds=seconds_left(state),
                            local_epochs=self.config.local_epochs, batch_size=self.config.batch_size,
                            learning_rate=self.config.learning_rate, extra_json=self._task_json,
                            model_bytes=self.layout.total_bytes, model_id=state.model_id)
        self.clock.stamp(task)
        payload = self.payload
        if slot.message:  # a Flower App run's round: the Message is the task (server/flower_rounds.py)
            task.flower_message = slot.message
        elif payload is not None and payload.inline is not None and payload.round_id == state.round_id:
            if with_weights:
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

    def inline_weights(self) -> tuple[bytes, bytes] | None:
        """The current round's small model as its tasks carry it (serialized ModelHeader, tensor bytes); None when
        the model is too big to travel inline or no round is open."""
        state, payload = self.current, self.payload
        if state is None or payload is None or payload.inline is None or payload.round_id != state.round_id:
            return None
        return payload.model_header, payload.inline

    def _redeliverable(self, state: RoundState, agent_id: str, finished_task_id: str = "") -> AgentSlot | None:
        """The task of an agent that pulls again before any download of it completed (the task reply or the
        download was lost on the way), so a lost message does not cost the agent its round; never the task
        the agent says it finished with. Secure rounds are excluded: their key exchange cannot be replayed."""
        slot = state.slots.get(agent_id)
        if slot is None or not slot.dispatched or slot.downloaded or slot.status != "pending" \
                or not self.mode.redelivers_tasks or slot.task_id == finished_task_id:
            return None
        return slot

    def _restarted(self, kind: str, ident: str) -> None:
        """A process started again under agent or simulation host ``ident`` (``kind``) joined: the open tasks of the
        current round that its killed process held (the agent's, or the host's members') are handed to it, so the
        round need not wait out its deadline for them; one that cannot be handed out again (:meth:`_why_not_again`)
        counts as failed at once. Said in one line."""
        state = self.current
        if state is None or state.closed or self.finished:
            return
        if kind == "agent":
            held = [ident] if ident in state.slots else []
        else:  # one pass over the round's open slots, not over the host's population
            held = [a for a, slot in state.slots.items() if slot.dispatched and slot.status in REOPENABLE]
            held = [a for a, (host, _) in zip(held, self.registry.member_hosts(held)) if host == ident]
        slots = [slot for a in held if (slot := state.slots[a]).dispatched and slot.status in REOPENABLE]
        why = [self._why_not_again(slot) for slot in slots]
        again = [slot for slot, no in zip(slots, why) if not no]
        failed = [(slot, no) for slot, no in zip(slots, why) if no and slot.status == "pending"]
        who = f"{kind} {ident!r}"
        if again:
            state.reopen(again)
            for slot in again:
                self._tasks[slot.agent_id] = slot
            ids = [slot.agent_id for slot in again]
            self.members.deal(ids)
            if isinstance(self.clock, VirtualClock):  # the clock let these go already: the new process may start
                self.members.let_go([slot.agent_id for slot in again if slot.go])
            log.info("round %d: %s started again; %s handed to its new process", state.round_id, who,
                     _tasks_named(ids))
        if failed:
            log.warning("round %d: %s started again; %s cannot be handed out again (%s): counted as failed",
                        state.round_id, who, _tasks_named([slot.agent_id for slot, _ in failed]), failed[0][1])
            state.fail_restarted([slot for slot, _ in failed])

    def _why_not_again(self, slot: AgentSlot) -> str:
        """Why ``slot``'s task cannot be handed to a new process of its member ('' when it can)."""
        if isinstance(self.mode, SecureRound):
            return "secure aggregation's key setup fixed this round's masks"
        if self.mode is not None and not self.mode.redelivers_tasks:  # (a Flower App's rounds have no mode)
            return "this round's tasks are not handed out twice"
        if slot.rank:
            return f"aggregator rank {slot.rank} takes its upload under the session of the killed process"
        return ""

    def download_completed(self, agent_id: str, round_id: int, task_id: str) -> None:
        """Note that ``agent_id`` received the whole model of its task (its task is no longer re-delivered)."""
        state = self.current
        if state is not None and state.round_id == round_id:
            slot = state.slots.get(agent_id)
            if slot is not None and slot.task_id == task_id:
                slot.downloaded = True
                state.download_bytes += self.layout.total_bytes

    def take_reply(self, agent_id: str, request: pb.MessageReply) -> None:
        """A member's reply to a Flower Message: only a Flower App run asks for any (server/flower_rounds.py)."""
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "this coordinator runs no Flower App; nothing to reply to")

    def leave(self, agent: AgentRecord) -> None:
        """Agent says goodbye."""
        self.members.leave(agent.agent_id)


def _tasks_named(agent_ids: Sequence[str]) -> str:
    """The open tasks of ``agent_ids`` as a log line names them (the first few ids)."""
    named = ", ".join(agent_ids[:5]) + (", ..." if len(agent_ids) > 5 else "")
    return f"the open task of {named}" if len(agent_ids) == 1 else f"the open tasks of {len(agent_ids)} ({named})"


def declared_columns(config: CoordinatorConfig) -> list[str]:
    """The metrics columns this configuration's rows may bring after the first (those every row has come with it):
    metrics.csv declares them up front so a later row does not widen it (protocol/run_logs.py)."""
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
