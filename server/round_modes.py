"""Round modes at the coordinator: plain and compressed rounds, and which mode each round gets.

A round mode (the RoundMode protocol in server/rounds.py) is what sets a kind of round apart: what its
tasks carry, which uploads it takes, how an upload becomes an update and joins the round's sum, and how
the round closes. The coordinator keeps the round policy (sampling, the deadline, first-K, the accounting).
:class:`PlainRound` folds each update into the strategy as it arrives (grouped with those that wait
for a fold: :class:`FoldQueue`); :class:`CompressedRound` decodes compressed deltas first; SecureRound
(server/secure_round.py) sums masked vectors and unmasks at the close.
A new mode is a new class here or beside it, and a line in :meth:`RoundModes.for_round`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections import deque
from concurrent.futures import Executor
from typing import Sequence

import grpc
import numpy as np

from fedpar.wording import counted
from fedpar.aggregation.compressed_delta import apply_delta, unpack_delta
from fedpar.aggregation.strategy import FoldItem
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout, reported_clip
from fedpar.protocol.compressed_wire import (CompressionConfig, EncodedUpdateError, encoded_specs, header_fields, knobs,
                                             with_compression)
from fedpar.protocol.task_settings import TaskSettings
from fedpar.server.config import CoordinatorConfig
from fedpar.server.deadline import secure_stage_seconds
from fedpar.server.registry import AgentRegistry
from fedpar.server.rounds import Refusal, RoundMode, RoundState, RunUpdate, UploadTicket
from fedpar.server.secure_round import SecureRound, check_secure_setup, default_max_weight
from fedpar.server.uploads import CheckedPartial, check_partial, in_thread, update_runner

log = logging.getLogger("fedpar.server")
MAX_ENCODING_JSON = 1024


class FoldQueue:
    """One fold at a time into ``strategy``, each taking every update that waits for it (loop only): accepted
    updates join the round's sum in groups when they arrive faster than it folds them.

    A running sum reads and writes its accumulator once per pass; an update that becomes ready while a fold runs
    waits here, and the next fold takes every waiting update (up to the strategy's group size) in one pass
    (``Strategy.fold_many``), so the accumulator's memory traffic is paid once per group. Updates fold in the order
    they were accepted, as one-by-one folds would (bit for bit the same sum). A waiting update is the staged upload's
    own arrays (no copy; the upload keeps its staging slot until its fold is done), so grouping adds no memory.
    """

    def __init__(self, strategy, run_update: RunUpdate, known_finite: bool):
        self.strategy = strategy
        self.fold_many = functools.partial(strategy.fold_many, known_finite=known_finite)
        self.run_update = run_update  # on the loop for small updates, on a worker thread for large ones
        self._waiting: deque[tuple[RoundState, FoldItem, asyncio.Future]] = deque()
        self._draining = False

    async def fold(self, state: RoundState, item: FoldItem) -> None:
        """Fold ``item`` into the strategy (with the others waiting); a ValueError if the strategy refused it (its
        state then unchanged by it: the rest of its group still counts)."""
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((state, item, done))
        if not self._draining:
            self._draining = True
            asyncio.ensure_future(self._drain())
        await done

    async def _drain(self) -> None:
        """Fold groups until none waits: each takes up to the strategy's group size, oldest first."""
        try:
            while self._waiting:
                group = [self._waiting.popleft() for _ in range(min(len(self._waiting), self.strategy.group_size))]
                started = time.perf_counter()
                try:
                    refused = await self.run_update(self.fold_many, [item for _, item, _ in group])
                except Exception as exc:  # not a refusal: the fold itself failed (the caller fails the round)
                    refused = [exc] * len(group)
                seconds = time.perf_counter() - started
                for state in {id(s): s for s, _, _ in group}.values():  # one round's, as a round closes after its folds
                    state.fold_seconds += seconds
                    state.fold_groups += 1
                    state.fold_group_max = max(state.fold_group_max, len(group))
                for (_, _, done), error in zip(group, refused):
                    if done.cancelled():
                        continue
                    if error is None:
                        done.set_result(None)
                    else:
                        done.set_exception(error)
        finally:
            self._draining = False


class PlainRound:
    """Plain rounds: agents upload their new weights; each is folded into the strategy as soon as it is accepted."""

    redelivers_tasks = True  # a task whose download was lost is handed out again (the round has nothing to replay)
    known_finite = True  # what is folded is what was received, already scanned for NaN/Inf

    def __init__(self, layout: ModelLayout, strategy, run_update: RunUpdate):
        self.layout = layout
        self.strategy = strategy
        self.run_update = run_update
        self.folds = FoldQueue(strategy, run_update, self.known_finite)

    def task_settings(self, settings: TaskSettings) -> TaskSettings:
        """``settings`` (the strategy's) with what this mode adds for every task."""
        return settings

    def start(self, state: RoundState) -> None:
        """The round opened."""

    def admit(self, agent_id: str) -> None:
        """Refuse, before the header is checked further, an upload this round takes from no such agent."""

    def expected_layout(self, header: pb.UploadHeader) -> tuple[ModelLayout, str]:
        """The layout the upload's tensors must have and what a refusal calls it; a Refusal for a wrong encoding."""
        if header.encoding:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"this run takes uncompressed updates, but the upload is encoded as "
                          f"{header.encoding[:32]!r}; send the new weights with no encoding")
        return self.layout, "the global model"

    async def decoded(self, global_weights: Sequence[np.ndarray], arrays: list[np.ndarray]) -> list[np.ndarray]:
        """The update a complete upload stands for (a final Refusal if its content is invalid)."""
        return arrays

    async def accept(self, state: RoundState, ticket: UploadTicket, arrays: list[np.ndarray]) -> None:
        """Count the update and fold it; the round may close on it before the fold is done."""
        report = (ticket.num_examples, ticket.metrics)
        state.count_accepted(ticket.slot, report)
        fold = asyncio.ensure_future(self.fold(state, ticket, arrays, report))
        state.pending_folds.add(fold)
        state.close_if_done()
        await fold

    async def fold(self, state: RoundState, ticket: UploadTicket, arrays: list[np.ndarray], report: tuple) -> None:
        """Fold through the fold queue (grouped with the updates waiting for it; on a worker thread unless tiny); a
        ValueError is the strategy refusing this update (its state unchanged)."""
        slot = ticket.slot
        try:
            await self.folds.fold(state, FoldItem(arrays, ticket.num_examples, slot.agent_id,
                                                  clipped=reported_clip(ticket.metrics)))
        except ValueError as exc:  # e.g. a client-side DP update above the clip norm: refuse it, keep the round
            state.withdraw(report)
            state.reject(slot, str(exc))
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None  # rejection already recorded
        except Exception:
            state.fail(f"folding the update of {slot.agent_id} failed")
            log.exception("round %d: folding the update of %s failed", state.round_id, slot.agent_id)
            raise

    async def accept_partial(self, partial: CheckedPartial) -> None:
        """Count a host's pre-summed update, checked just now on the loop, for all its members and fold it as one
        block (the round may close on it before the fold is done); a Refusal, counting none of them and folding
        nothing, if the strategy refused it (its members may then send their updates one by one)."""
        state, members = partial.state, tuple(slot.agent_id for slot in partial.slots)
        for slot, report in zip(partial.slots, partial.reports):
            state.count_accepted(slot, report)
        fold = asyncio.ensure_future(self.folds.fold(state, FoldItem(partial.arrays, partial.total_weight,
                                                                     members=members)))
        state.pending_folds.add(fold)
        state.close_if_done()
        try:
            await fold
        except ValueError as exc:
            for slot, report in zip(partial.slots, partial.reports):
                state.withdraw(report)
                slot.status = "pending"
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"{exc}; the partial was not applied") from None
        except Exception:
            state.fail(f"folding a partial of {len(members)} members failed")
            log.exception("round %d: folding a partial of %d members failed", state.round_id, len(members))
            raise

    async def close(self, state: RoundState, global_weights: Sequence[np.ndarray]) -> None:
        """The round closed: wait for the folds still running (a refused or failed one is already recorded)."""
        if state.pending_folds:
            await asyncio.gather(*state.pending_folds, return_exceptions=True)

    def metrics(self) -> dict:
        """This mode's columns of the round's metrics row."""
        return {}


class CompressedRound(PlainRound):
    """Compressed rounds: uploads have the exact encoded layout of the run's compression (the wire format:
    protocol/compressed_wire.py); the update folded is global + the decoded delta (aggregation/compressed_delta.py)."""

    known_finite = False  # global + delta may still overflow: the strategy checks what it folds

    def __init__(self, model_layout: ModelLayout, config: CompressionConfig, strategy, run_update: RunUpdate):
        self.config = config
        self.model_specs = model_layout.specs()
        self.encoding, self.encoding_json = header_fields(config)
        super().__init__(ModelLayout(encoded_specs(self.model_specs, config)), strategy, run_update)
        self.described = (f"the {config.method} encoding of the global model this run expects "
                          f"({self.encoding_json})")

    def task_settings(self, settings: TaskSettings) -> TaskSettings:
        """``settings`` plus the compression every agent must use."""
        return with_compression(settings, self.config)

    def expected_layout(self, header: pb.UploadHeader) -> tuple[ModelLayout, str]:
        """The encoded layout, if ``header`` names this run's encoding and knobs; else a Refusal."""
        if header.encoding != self.encoding:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"this run takes {self.encoding}-compressed updates ({self.encoding_json}), but the upload "
                          f"is encoded as {header.encoding[:32] or 'none'!r}; compress as the task's extra_json says")
        try:
            if len(header.encoding_json) > MAX_ENCODING_JSON:
                raise ValueError(f"longer than {MAX_ENCODING_JSON} characters")
            sent = json.loads(header.encoding_json or "{}")
        except ValueError as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"encoding_json is not valid: {exc}") from None
        if sent != knobs(self.config):
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"encoding_json {header.encoding_json[:200]!r} does not match this run's "
                          f"{self.encoding} settings {self.encoding_json}")
        return self.layout, self.described

    async def decoded(self, global_weights: Sequence[np.ndarray], arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Global + the decoded delta (off the loop for large models); a final Refusal if the content is invalid."""
        return await self.run_update(self._new_weights, global_weights, arrays)

    def _new_weights(self, global_weights: Sequence[np.ndarray], arrays: list[np.ndarray]) -> list[np.ndarray]:
        try:
            return apply_delta(self.model_specs, global_weights, unpack_delta(self.model_specs, self.config, arrays))
        except EncodedUpdateError as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"{exc}; the update was not applied",
                          final=True) from None


async def take_host_partial(plane, host_id: str, partial: pb.HostPartial) -> pb.UploadReply:
    """A population host's pre-summed update, checked as a whole and folded as one block, where this run's round
    can take it: a plain round of a linear strategy with no share cap (the cap may clip any one update's weight,
    which needs the update itself). Else UNIMPLEMENTED: the host sends its members' updates one by one. On an
    aggregator rank other than 0, rank 0 counts the partial's members first (all or none: a refusal there leaves
    them to send their updates one by one)."""
    if plane.current is not None:
        await plane.current.ready_to_count()
    mode, strategy, state = plane.mode, plane.strategy, plane.current
    if mode is None or state is None:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, f"partial for round {partial.round}, but no round is "
                                                           "open; the update was not applied")
    reason = ("this round's updates are compressed or masked" if type(mode) is not PlainRound
              else f"strategy {strategy.name!r} needs each update (it is not linear)" if not strategy.linear
              else "--max-agent-share may cap any one update's weight" if strategy.max_share is not None else "")
    if reason:
        raise Refusal(grpc.StatusCode.UNIMPLEMENTED, f"pre-summed updates are not taken here: {reason}; send each "
                                                     "member's update")
    checked = check_partial(plane, host_id, partial)
    if state.on_count is not None:  # another aggregator rank: rank 0 counts the members first, all or none
        try:
            await state.on_count(state, checked.slots, checked.reports)
        except Refusal:  # the members may send their updates one by one
            for slot in checked.slots:
                slot.status = "pending"
            raise
    try:
        await mode.accept_partial(checked)  # no await between the checks (or rank 0's count) and the count here
    except Refusal as refused:
        if state.on_count is not None:  # rank 0 counted them: rejected here, they are taken back there
            for slot in checked.slots:
                state.reject(slot, refused.message)
        raise
    return pb.UploadReply(accepted=True, message=f"{counted(len(checked.slots), 'update')} accepted for round {state.round_id}")


class RoundModes:
    """The run's round modes; raises ValueError at once if the model or strategy cannot run them."""

    def __init__(self, config: CoordinatorConfig, names: Sequence[str], weights: Sequence[np.ndarray], strategy,
                 executor: Executor):
        if config.secure_aggregation:
            check_secure_setup(names, weights, strategy)
            if config.secagg_max_weight is not None and strategy.privacy_level != "off":
                raise ValueError("--secagg-max-weight does not apply with --privacy: DP-FedAvg weighs each update 1, "
                                 "which a secure round under DP holds every agent to; leave it out")
        if config.max_agent_share is not None:
            strategy.cap_shares(config.max_agent_share)
        self.config = config
        self.strategy = strategy
        self.in_thread = functools.partial(in_thread, executor)  # unmasking always runs on a worker thread
        layout = ModelLayout.of_arrays(names, weights)
        run_update = update_runner(layout.total_bytes, executor)
        self.run_mode = (CompressedRound(layout, config.upload_compression, strategy, run_update)
                         if config.upload_compression.method != "none" else PlainRound(layout, strategy, run_update))

    def for_round(self, round_id: int, cohort: list[str], registry: AgentRegistry,
                  weights: Sequence[np.ndarray]) -> RoundMode:
        """The mode of round ``round_id`` over ``cohort``, on top of the global ``weights``."""
        c = self.config
        if not c.secure_aggregation:
            return self.run_mode
        if self.strategy.privacy_level != "off":  # DP-FedAvg weighs each update 1: no agent may claim more
            max_weight = 1
        else:
            registered = [r.num_examples for r in registry.get_many(cohort) if r]
            max_weight = c.secagg_max_weight or default_max_weight(registered, c.local_epochs, len(cohort))
        return SecureRound(round_id, cohort, weights, c.secagg_clip, max_weight, secure_stage_seconds(c),
                           self.strategy, self.in_thread)
