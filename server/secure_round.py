"""Secure aggregation at the coordinator: drives one SecAgg+ round over gRPC and folds only the unmasked mean.

Flow (agent side in client/secure_upload.py):
  task dispatch ──> SETUP (params) ──> ADVERTISE keys ──[stage 1 closes]──> neighbours' keys
  ──> SHARE encrypted shares ──[stage 2 closes]──> shares addressed to the agent
  ──> masked vector via UploadUpdate (tensor "secagg.masked", int32 bits of the uint32 field vector)
  ──[round closes: all uploaded / target / deadline]──> survivor list ──> UNMASK shares ──> unmasking.
Masked vectors reuse the chunked UploadUpdate path (bounded staging, chunk checks, the raw fast path,
the deadline and late-upload refusal) instead of a second streaming RPC; the coordinator adds each one
into a single running uint32 sum, so its memory stays about one model whatever the cohort size.
Each agent uploads delta = local - global, clipped, quantized and weighted by its example count; the
strategy then receives one update, global + sum(w*delta)/sum(w), with weight sum(w). Only linear
strategies (``Strategy.linear``: FedAvg, FedProx and the FedOpt family) give the same result as without masking,
and DP-FedAvg in client mode: its agents clip, weigh 1 and add their clip bit after the update
(``Strategy.secure_values``), and it takes the sum and the bits' count (``Strategy.fold_secure_sum``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import replace
from typing import Callable, Sequence

import grpc
import numpy as np

from fedpar.aggregation.compatibility import check_composition, linear_strategy_names
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import FLOAT_DTYPES, NO_RUN_IN_PROGRESS, ModelLayout
from fedpar.wording import counted
from fedpar.secagg import wire
from fedpar.secagg.errors import SecAggAbort, SecAggError, SecAggStageError
from fedpar.secagg.field import DTYPE
from fedpar.secagg.messages import MaskedInput
from fedpar.secagg.params import RoundParams
from fedpar.protocol.task_settings import TaskSettings
from fedpar.secagg.server_protocol import SecAggResult, SecAggServer
from fedpar.server.deadline import SECURE_FAILED, TARGET_REACHED, secure_closing_reason, set_within
from fedpar.server.rounds import Refusal, RoundState, RunUpdate, UploadTicket, not_this_round

log = logging.getLogger("fedpar.server")
MASKED_TENSOR = "secagg.masked"
MAX_POLL_SECONDS = 30.0


def check_secure_setup(names: Sequence[str], weights: Sequence[np.ndarray], strategy) -> None:
    """Raise ValueError unless this model and strategy can be aggregated under masking."""
    check_composition(strategy.name, secure_aggregation=True, privacy=strategy.privacy_level)
    refusal = strategy.secure_sum_refusal()
    if refusal is not None:
        raise ValueError(f"{refusal}; choose one of {', '.join(linear_strategy_names())}")
    bad = [n for n, w in zip(names, weights) if w.dtype.name not in FLOAT_DTYPES]
    if bad:
        raise ValueError(f"secure aggregation needs floating-point tensors only; {bad[:3]} are not")


def default_max_weight(registered_examples: Sequence[int], local_epochs: int, cohort: int) -> int:
    """W: the largest weight an agent of this cohort can honestly claim, kept inside the 31-bit budget."""
    claimed = max((n * local_epochs for n in registered_examples), default=0) or 10_000
    return max(1, min(claimed, (2**31 - 1) // (2 * cohort)))


def masked_layout(vector_length: int) -> ModelLayout:
    """The single-tensor layout masked uploads must have."""
    return ModelLayout([(MASKED_TENSOR, "int32", (vector_length + 1,))])


class SecureRound:
    """Secure rounds (a RoundMode): one round's SecAgg+ server, its stage timing, and the replies to SecAggExchange."""

    redelivers_tasks = False  # the key exchange of a task cannot be replayed

    def __init__(self, round_id: int, cohort: Sequence[str], weights: Sequence[np.ndarray], clip: float,
                 max_weight: int, stage_seconds: float, strategy, in_thread: RunUpdate):
        # the model's values and what each agent adds after its update (DP's clip bit)
        length = sum(int(w.size) for w in weights) + strategy.secure_values
        self.layout = masked_layout(length)
        self.strategy = strategy
        self.in_thread = in_thread
        self.round_id = round_id
        self.stage_seconds = stage_seconds
        self.failure: str | None = None
        try:
            self.params: RoundParams | None = RoundParams.create(round_id, cohort, length, clip, max_weight)
            self.server: SecAggServer | None = SecAggServer(self.params)
        except SecAggError as exc:  # e.g. a cohort of one: masking cannot hide a lone update
            self.params = self.server = None
            self.failure = f"cannot set up secure aggregation for {counted(len(cohort), 'agent')}: {exc}"
        self.result: SecAggResult | None = None
        self.surplus = 0  # agents that shared keys but were not needed: the round reached its target first
        self.unmask_seconds = 0.0
        self.unmask_cpu_seconds = 0.0
        self._changed = asyncio.Event()  # set by every stage message (server-side stage drivers wait on it)
        self._stage_changed = asyncio.Event()  # set when a stage closes or the round fails (long-polls wait on it)
        self._key_stages: asyncio.Task | None = None
        self._finishing = False
        self._started = time.monotonic()
        self.marks: dict[str, float] = {}  # seconds from round start at which each stage closed

    # ------------------------------------------------------------------ timing of the stages
    def _notify(self, stage: bool = False) -> None:
        """Wake the stage drivers to re-check their conditions; ``stage``: a stage closed or the round failed, so
        wake the agents' long-polls too (they wait for nothing else: woken by every message, n agents' polls
        would wake n times each per stage)."""
        old, self._changed = self._changed, asyncio.Event()
        old.set()
        if stage:
            old, self._stage_changed = self._stage_changed, asyncio.Event()
            old.set()

    async def _until(self, ready: Callable[[], bool], seconds: float, stage_only: bool = False) -> None:
        end = time.monotonic() + seconds
        while not ready() and self.failure is None:
            remaining = end - time.monotonic()
            if remaining <= 0:
                return
            event = self._stage_changed if stage_only else self._changed
            if not await set_within(event, remaining):
                return

    def _fail(self, reason: str, state: RoundState | None = None) -> None:
        if self.failure is None:
            self.failure = reason
            log.warning("round %d: secure aggregation failed: %s", self.round_id, reason)
        if state is not None:
            state.fail(f"secure aggregation failed: {self.failure}")
            state.close(SECURE_FAILED)
        self._notify(stage=True)

    def task_settings(self, settings: TaskSettings) -> TaskSettings:
        """``settings`` plus the order to mask the upload."""
        return replace(settings, secure_aggregation=True)

    def start(self, state: RoundState) -> None:
        """Run stages 1 and 2 in the background while agents train."""
        if self.failure is not None:
            self._fail(self.failure, state)
            return
        self._key_stages = asyncio.ensure_future(self._run_key_stages(state))

    async def _run_key_stages(self, state: RoundState) -> None:
        s, everyone = self.server, set(self.params.participants)

        def all_advertised() -> bool:  # under the virtual clock, once it chose: every member it lets train
            answering = everyone if state.answering is None else {a for a, slot in state.slots.items() if slot.go}
            return answering <= set(s.advertised)
        try:
            await self._until(all_advertised, self.stage_seconds)
            s.close_advertising()
            self._mark("advertised")
            self._notify(stage=True)
            await self._until(lambda: s.shared == s.advertised, self.stage_seconds)
            s.close_sharing()
            self._mark("shared")
            self._notify(stage=True)
        except SecAggAbort as exc:
            self._fail(str(exc), state)

    # ------------------------------------------------------------------ masked uploads
    def admit(self, agent_id: str) -> None:
        """Refuse a masked upload from an agent that did not share keys this round."""
        if self.failure is not None:
            raise Refusal(grpc.StatusCode.ABORTED, f"secure aggregation of this round failed: {self.failure}")
        if self.server.stage != "mask" or agent_id not in self.server.shared:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"masked input from {agent_id!r} in stage {self.server.stage!r}: an agent uploads "
                          "only after it shared its keys and the sharing stage closed")

    def expected_layout(self, header: pb.UploadHeader) -> tuple[ModelLayout, str]:
        """The single int32 tensor of the masked vector."""
        return self.layout, "the masked vector of this secure round"

    async def decoded(self, global_weights: Sequence[np.ndarray], arrays: list[np.ndarray]) -> list[np.ndarray]:
        """The masked vector as received (it is unmasked only in sum)."""
        return arrays

    async def accept(self, state: RoundState, ticket: UploadTicket, arrays: list[np.ndarray]) -> None:
        """Add the masked vector to the running sum; nothing reaches the strategy before unmasking."""
        all_in = self.add_masked(ticket.slot.agent_id, arrays[0])
        # Per-agent metrics would reveal more than the sum: agents send none, and any sent are dropped.
        state.count_accepted(ticket.slot)
        reason = secure_closing_reason(state.accepted, state.target, all_in)
        if reason:
            state.close(reason)
        else:  # each other one that may answer did (one whose process was killed and started again is lost)
            state.close_if_done()

    def add_masked(self, agent_id: str, array: np.ndarray) -> bool:
        """Add a validated masked upload to the sum; True when every agent that shared keys has uploaded."""
        try:
            self.server.receive_masked(wire_masked(agent_id, array))
        except SecAggError as exc:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, str(exc), final=True) from None
        self._notify()
        return self.server.survivors == self.server.shared

    # ------------------------------------------------------------------ unmasking
    async def close(self, state: RoundState, global_weights: Sequence[np.ndarray]) -> None:
        """Close stage 3, collect unmask shares, remove the masks and fold the mean into the strategy."""
        if self._key_stages is not None:
            self._key_stages.cancel()
        s = self.server
        if self.failure is None and s.stage != "mask":
            self._fail(f"the round closed ({state.close_reason}) before the key stages finished (stage {s.stage!r})",
                       state)
        if self.failure is not None:
            state.fail(f"secure aggregation failed: {self.failure}")
            return
        try:
            s.close_masking()
            self._mark("masked")
            self._notify(stage=True)
            await self._until(lambda: s.responded == s.survivors, self.stage_seconds)
            self._finishing = True
            self._mark("unmask_shares")
            start = time.perf_counter()
            self.result, self.unmask_cpu_seconds = await self.in_thread(_timed, s.finish)
            self.unmask_seconds = time.perf_counter() - start
        except SecAggAbort as exc:
            self._fail(str(exc), state)
            return
        finally:
            self._notify(stage=True)
        r = self.result
        state.examples = r.weight_sum if self.strategy.privacy_level == "off" else None  # DP: each weighs 1
        update, offset = [], 0
        for w in global_weights:
            delta = r.mean[offset:offset + w.size].reshape(w.shape)
            update.append((w.astype(np.float64) + delta).astype(w.dtype))
            offset += w.size
        # the values each agent added after its update, summed (its weight 1 each: DP's clip bits, as a count)
        sums = [float(v) * r.weight_sum / self.params.bit_value for v in r.mean[offset:]]
        try:
            await self.in_thread(self.strategy.fold_secure_sum, update, r.weight_sum, len(r.survivors), sums)
        except ValueError as exc:  # what the agents masked does not add up (e.g. a DP clip bit other than 0 or 1)
            self._fail(f"the unmasked sum was refused: {exc}", state)
            return
        self.surplus = len(r.dropped) - len(self._dropped(state, r.dropped))
        log.info("round %d: unmasked the sum of %d agents (%s) in %.2fs", self.params.round_id, len(r.survivors),
                 self._absent_words(len(r.dropped)), self.unmask_seconds)

    @staticmethod
    def _dropped(state: RoundState, absent) -> list[str]:
        """Of ``absent`` (agents that shared keys but whose masked input the sum lacks), those that dropped out: all of
        them unless the round reached its target first, which needed none of the others."""
        if state.close_reason != TARGET_REACHED:
            return list(absent)
        return [a for a in absent if (slot := state.slots.get(a)) is None
                or slot.status not in ("pending", "uploading", "late")]

    def _absent_words(self, absent: int) -> str:
        """Who of the ``absent`` agents (keys shared, input missing from the sum) dropped and who was not needed."""
        dropped = absent - self.surplus
        needless = f", {self.surplus} not needed: the target was reached first" if self.surplus else ""
        return f"{dropped} dropped after sharing keys{needless}"

    def _mark(self, stage: str) -> None:
        self.marks[stage] = time.monotonic() - self._started

    def metrics(self) -> dict:
        """Columns for the round's metrics row."""
        row = {"secagg_survivors": len(self.server.survivors) if self.server else 0,
               "secagg_unmask_seconds": self.unmask_seconds,
               "secagg_unmask_cpu_seconds": self.unmask_cpu_seconds,
               **{f"secagg_{k}_at": v for k, v in self.marks.items()}}
        if self.result is not None:
            row.update(secagg_dropped=len(self.result.dropped) - self.surplus, secagg_not_needed=self.surplus,
                       secagg_error_bound=self.result.error_bound)
        if self.failure is not None:
            row["secagg_failure"] = self.failure
        return row

    # ------------------------------------------------------------------ SecAggExchange
    async def exchange(self, agent_id: str, request: pb.SecAggRequest) -> pb.SecAggReply:
        """Take this agent's stage message, then long-poll for the server's next broadcast to it."""
        wait = request.wait_seconds
        wait = 0.0 if math.isnan(wait) else min(max(wait, 0.0), MAX_POLL_SECONDS)  # NaN would wait forever
        stage, body = request.stage, request.WhichOneof("body")
        expected_body = {pb.SECAGG_ADVERTISE: "public_keys", pb.SECAGG_SHARE: "ciphertexts",
                         pb.SECAGG_UNMASK: "unmask_shares"}.get(stage)
        if body is not None and body != expected_body:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"stage {_stage_name(stage)} takes "
                          f"{expected_body or 'no body'}, not {body}")
        if self.failure is not None:
            raise Refusal(grpc.StatusCode.ABORTED, f"secure aggregation of this round failed: {self.failure}")
        s = self.server
        try:
            if stage == pb.SECAGG_SETUP:
                return pb.SecAggReply(params_json=self.params.to_json())
            if stage == pb.SECAGG_ADVERTISE:
                if body:
                    s.receive_advertise(wire.advertise_from_pb(agent_id, request.public_keys))
                    self._notify()
                if not await self._ready(lambda: s.stage != "advertise", wait):
                    return pb.SecAggReply(wait_seconds=0.0)
                return pb.SecAggReply(keys=wire.key_broadcast_to_pb(s.key_broadcast(agent_id)))
            if stage == pb.SECAGG_SHARE:
                if body:
                    s.receive_shares(wire.share_keys_from_pb(agent_id, request.ciphertexts))
                    self._notify()
                if not await self._ready(lambda: s.stage not in ("advertise", "share"), wait):
                    return pb.SecAggReply(wait_seconds=0.0)
                return pb.SecAggReply(ciphertexts=wire.ciphertexts_to_pb(s.routed_shares(agent_id).ciphertexts))
            if stage == pb.SECAGG_MASKED:
                if not await self._ready(lambda: s.stage not in ("advertise", "share", "mask"), wait):
                    return pb.SecAggReply(wait_seconds=0.0)
                return pb.SecAggReply(survivors=pb.SecAggSurvivors(agent_ids=s.unmask_request(agent_id).survivors))
            if stage == pb.SECAGG_UNMASK:
                if not body:
                    raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "SECAGG_UNMASK needs unmask_shares")
                if self._finishing:
                    raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "unmasking already started; too late")
                s.receive_unmask(wire.unmask_shares_from_pb(agent_id, request.unmask_shares))
                self._notify()
                return pb.SecAggReply(done=f"unmask shares accepted for round {self.params.round_id}")
        except SecAggStageError as exc:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        except SecAggError as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except SecAggAbort as exc:
            raise Refusal(grpc.StatusCode.ABORTED, str(exc)) from None
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"unknown secure-aggregation stage {stage}")

    async def _ready(self, ready: Callable[[], bool], wait: float) -> bool:
        await self._until(ready, wait, stage_only=True)
        if self.failure is not None:
            raise SecAggAbort(f"secure aggregation of this round failed: {self.failure}")
        return ready()


def _stage_name(stage: int) -> str:
    """The enum name of a known stage, else its number (requests may carry any value)."""
    return pb.SecAggStage.Name(stage) if stage in pb.SecAggStage.values() else str(stage)


def _timed(fn):
    """fn() and the CPU seconds this thread spent in it."""
    start = time.thread_time()
    result = fn()
    return result, time.thread_time() - start


def wire_masked(agent_id: str, array: np.ndarray):
    """The MaskedInput of an upload whose single int32 tensor carries the uint32 field vector's bits."""
    return MaskedInput(agent_id, np.ascontiguousarray(array).reshape(-1).view(DTYPE))


async def secagg_exchange(coordinator, agent_id: str, request: pb.SecAggRequest) -> pb.SecAggReply:
    """Route a SecAggExchange call of an authenticated agent to the current round's SecureRound."""
    secure, state = coordinator.secure, coordinator.current
    if not coordinator.runs_rounds:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                      f"secure-aggregation message for round {request.round}, but {NO_RUN_IN_PROGRESS} on this "
                      "service: the run it was for ended (it finished or was stopped)")
    if not coordinator.config.secure_aggregation:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                      "this coordinator does not run secure aggregation (start it with --secure-aggregation)")
    if state is None or secure is None or request.round != state.round_id:
        raise not_this_round("secure-aggregation message", request.round, coordinator.current_round_id, applied="")
    state.slot_for(agent_id, request.task_id)
    return await secure.exchange(agent_id, request)
