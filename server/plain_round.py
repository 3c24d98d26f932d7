"""Round modes at the coordinator, and the plain one: agents upload their new weights, each folded as it arrives.

A round mode is what sets a kind of round apart; the coordinator keeps the round policy (sampling, the
deadline, first-K, the accounting) and asks the round's mode for the rest:
  task_settings  what every task of the round carries
  start          the round opened (secure rounds begin their key exchange)
  admit, expected_layout   which uploads the round takes, and the layout their tensors must have
  decoded, accept          what a received upload stands for, and how it joins the round's sum
  close, metrics           finish combining when the round closes; its columns of the metrics row
:class:`PlainRound` is the interface with the plain behaviour; CompressedRound (server/compressed_round.py)
and SecureRound (server/secure_round.py) override what they change. server/round_modes.py picks one per round.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Awaitable, Callable, Sequence

import grpc
import numpy as np

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout
from fedpar.protocol.task_settings import TaskSettings
from fedpar.server.rounds import Refusal, RoundState, UploadTicket

log = logging.getLogger("fedpar.server")
RunUpdate = Callable[..., Awaitable]  # runs fn(*args) for one update, on the loop or a worker thread


class PlainRound:
    """Agents upload their new weights; each update is folded into the strategy as soon as it is accepted."""

    redelivers_tasks = True  # a task whose download was lost is handed out again (the round has nothing to replay)
    known_finite = True  # what is folded is what was received, already scanned for NaN/Inf

    def __init__(self, layout: ModelLayout, strategy, run_update: RunUpdate):
        self.layout = layout
        self.strategy = strategy
        self.run_update = run_update

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
        fold = asyncio.ensure_future(self._fold(state, ticket, arrays, report))
        state.pending_folds.add(fold)
        state.close_if_done()
        await fold

    async def _fold(self, state: RoundState, ticket: UploadTicket, arrays: list[np.ndarray], report: tuple) -> None:
        """Fold (on a worker thread unless tiny); a ValueError is the strategy refusing this update (its state unchanged)."""
        slot = ticket.slot
        try:
            await self.run_update(functools.partial(self.strategy.fold, known_finite=self.known_finite),
                                  arrays, ticket.num_examples, slot.agent_id)
        except ValueError as exc:  # e.g. a client-side DP update above the clip norm: refuse it, keep the round
            state.withdraw(report)
            state.reject(slot, str(exc))
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None  # rejection already recorded
        except Exception:
            state.fold_failed = True
            log.exception("round %d: folding the update of %s failed", state.round_id, slot.agent_id)
            raise

    async def close(self, state: RoundState, global_weights: Sequence[np.ndarray]) -> None:
        """The round closed and its folds are done: finish combining (plain: nothing left to do)."""

    def metrics(self) -> dict:
        """This mode's columns of the round's metrics row."""
        return {}
