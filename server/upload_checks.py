"""The checks an upload header passes before any of its data is taken: round, slot, duplicates, weight, layout."""

from __future__ import annotations

import math
from typing import NoReturn

import grpc

from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import CodecError, ModelLayout, ModelTooLarge
from fedpar.protocol.messages import layout_from_pb, specs_match
from fedpar.server.config import CoordinatorConfig
from fedpar.server.registry import AgentRecord
from fedpar.server.rounds import Refusal, RoundMode, RoundState, UploadTicket

MAX_CLIENT_METRICS = 64


def open_ticket(state: RoundState | None, mode: RoundMode | None, agent: AgentRecord, header: pb.UploadHeader,
                config: CoordinatorConfig, current_round_id: int, rank: int = 0) -> UploadTicket:
    """Validate ``agent``'s upload header against the open round ``state`` on aggregator ``rank``; its ticket, or a
    Refusal saying what is wrong (the slot is marked uploading only when every check passed)."""
    if state is None or header.round != state.round_id:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                      f"upload for round {header.round}, but the current round is {current_round_id}; "
                      "the update was not applied")
    state.check_open()
    slot = state.slot_for(agent.agent_id, header.task_id)
    if slot.rank != rank:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                      f"agent {agent.agent_id!r} uploads to aggregator rank {slot.rank} this round (its task says "
                      f"where), not to rank {rank}; the update was not applied")
    mode.admit(agent.agent_id)
    if slot.status in ("uploading", "accepted", "rejected"):
        raise Refusal(grpc.StatusCode.ALREADY_EXISTS,
                      f"agent {agent.agent_id!r} already sent an update in round {state.round_id} "
                      f"({slot.status}); duplicates are refused")
    max_examples = agent.num_examples * config.local_epochs  # Join made num_examples >= 1
    if not 1 <= header.num_examples <= max_examples:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                      f"num_examples={header.num_examples} must be in 1..{max_examples} "
                      f"({agent.num_examples} registered examples x {config.local_epochs} epochs)")
    if header.steps < 0:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "steps must be >= 0")
    expected, described = mode.expected_layout(header)
    if not specs_match(header.tensors, expected):
        _refuse_tensors(header, config, expected, described)
    if header.total_bytes != expected.total_bytes:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                      f"total_bytes={header.total_bytes} but the tensors need {expected.total_bytes}")
    metrics = dict(header.metrics)
    if len(metrics) > MAX_CLIENT_METRICS or not all(math.isfinite(v) and len(k) <= 64 for k, v in metrics.items()):
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                      f"metrics: at most {MAX_CLIENT_METRICS} finite values with names <= 64 characters")
    slot.status, slot.upload_bytes = "uploading", expected.total_bytes
    return UploadTicket(state, slot, int(header.num_examples), metrics, expected, mode)


def _refuse_tensors(header: pb.UploadHeader, config: CoordinatorConfig, expected: ModelLayout,
                    described: str) -> NoReturn:
    """Refuse a header whose tensors are not ``expected``'s, saying what is wrong with them."""
    try:
        layout = layout_from_pb(header.tensors, config.max_model_bytes)
    except ModelTooLarge as exc:
        raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"tensor header refused: {exc} (--max-model-bytes); "
                      "the update was not applied") from None
    except CodecError as exc:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"bad tensor header: {exc}") from None
    raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                  f"update does not match {described}: {layout.mismatch(expected) or 'its tensors differ'}")
