"""A Flower App's ServerApp on fedpar's coordinator: each batch of Flower Messages its Grid sends is one fedpar
round (sampled = the messages' nodes, the deadline = the Grid's timeout capped by --deadline-seconds, first K =
every node), whose tasks carry the Messages (TrainTask.flower_message) and whose answers are the members' reply
Messages (the ReplyMessage call), each checked on receipt. A node that misses the deadline gives no reply, as
Flower's ``send_and_receive`` with a timeout; a reply that cannot be taken (it does not parse, answers another
Message, or holds NaN or Inf arrays, which no strategy may fold into the global model) becomes that node's error
reply."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from typing import Callable, Sequence

import grpc
import numpy as np

from fedpar.aggregation.accumulator import all_finite
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.flower_nodes import node_id_of
from fedpar.protocol.flower_wire import FlowerWireError, decode_message
from fedpar.server.config import CoordinatorConfig
from fedpar.server.coordinator import Coordinator, cohort_digest
from fedpar.server.deadline import DEADLINE, until_closed, wall_seconds
from fedpar.server.rounds import AgentSlot, Refusal, RoundState, not_this_round

log = logging.getLogger("fedpar.server")
# The coordinator keeps a model layout for its weight path; a Flower run's arrays are the ServerApp's, known only
# once it returns them: until then the coordinator holds this one-element stand-in (never sent: no task of a
# Flower round carries weights).
STAND_IN_NAMES, STAND_IN_WEIGHTS = ["flower.pending"], [np.zeros(1, np.float32)]
# A ServerApp's main(grid) on a thread of its own: it returns the final (names, arrays), or None, and a summary
AppMain = Callable[["FlowerCoordinator"], tuple[tuple[list[str], list[np.ndarray]] | None, dict]]


class FlowerCoordinator(Coordinator):
    """The coordinator of a Flower App run: instead of its own rounds, it runs ``app_main`` (the ServerApp's main on
    a fedpar Grid, server/flower_grid.py) and serves the rounds of Messages that it asks for."""

    def __init__(self, config: CoordinatorConfig, strategy, app_main: AppMain, **kwargs):
        super().__init__(config, STAND_IN_NAMES, STAND_IN_WEIGHTS, strategy, **kwargs)
        self.app_main = app_main
        self.loop: asyncio.AbstractEventLoop | None = None
        self.flower_summary: dict = {}  # what the ServerApp's Result held (summary.json's "flower")
        self.sent_arrays = None  # the ArrayRecord the last message that carried one sent out: the global model
        self._replies: dict[str, object] = {}  # the open round's reply Messages by agent id
        self._messages: dict[str, object] = {}  # the open round's Messages by agent id (what a reply must answer)
        self._one_round = asyncio.Lock()
        self.flower_round = 0  # the ServerApp's server round of the last batch of Messages

    def finished_reason(self) -> str:
        """The one line a member hears when the ServerApp is done: its own rounds, and the batches of Messages."""
        return (f"the Flower ServerApp finished after server round {self.flower_round} "
                f"({self.round_id} rounds of Messages)")

    async def run(self) -> None:
        """Wait for the members the run asks for, run the ServerApp to its end, keep its final arrays."""
        self.loop = asyncio.get_running_loop()
        self._ready(True)
        stopped_early = False
        try:
            await self.members.wait_for_live(self.config.min_available, self.config.wait_for_agents_seconds)
            final, self.flower_summary = await on_daemon_thread(self.app_main, self)
            if final is not None:
                self.names, self.weights = final
        except asyncio.CancelledError:
            stopped_early = True
            self._keep_sent_arrays()
            raise
        finally:
            self._ready(False)
            self.finished = not stopped_early
            self.members.finish(tell=not stopped_early)

    def _keep_sent_arrays(self) -> None:
        """A run stopped before the ServerApp returned keeps the global model its messages last carried (the
        stand-in is no model)."""
        if self.sent_arrays is not None and len(self.sent_arrays):
            self.names, self.weights = sent_model(self.sent_arrays)

    def node_agents(self) -> list[str]:
        """The live members (the Grid's nodes), on the loop."""
        return list(self.members.live_ids())

    async def exchange(self, messages: dict[str, tuple[bytes, object]], timeout: float | None,
                       message_type: str = "", flower_round: int = 0) -> dict[str, object]:
        """Send each agent its (serialized, Message) as one round; the reply Messages that arrived (or became error
        replies) before all answered or the deadline passed, by agent id."""
        if not messages:  # e.g. a strategy that evaluates on no node: no round
            return {}
        async with self._one_round:
            round_id = self.round_id + 1
            deadline = wall_seconds(self.config) if timeout is None else min(timeout, wall_seconds(self.config))
            slots = {a: AgentSlot(a, secrets.token_hex(8), message=data) for a, (data, _) in messages.items()}
            state = RoundState(round_id, len(slots), 0, deadline, slots)
            self._messages = {a: message for a, (_, message) in messages.items()}
            self._replies = {}
            self.current = state
            self._tasks.update(slots)
            self.members.deal(list(slots))
            log.info("round %d: %d Flower %r messages (server round %d)", round_id, len(slots), message_type,
                     flower_round)
            if not await until_closed(state, state.closed_event):
                state.close(DEADLINE)
            for agent_id, slot in slots.items():
                if self._tasks.get(agent_id) is slot:
                    del self._tasks[agent_id]
            replies, self._replies, self._messages = self._replies, {}, {}
            self.round_id, self.flower_round = round_id, max(self.flower_round, flower_round)
            now = time.monotonic()
            row = {
                "round": round_id, "status": exchange_status(replies.values(), len(slots)), "sampled": len(slots),
                "reported": state.accepted, "error_replies": sum(r.has_error() for r in replies.values()),
                "rejected": state.rejected, "late": state.late(),  # no "examples": a reply weighs as its strategy says
                "close_reason": state.close_reason, "cohort_digest": cohort_digest(slots),
                "flower_round": flower_round, "message_type": message_type, "upload_bytes": state.upload_bytes,
                "download_bytes": sum(len(s.message) for s in slots.values() if s.dispatched),
                "round_seconds": now - state.started, "wall_seconds": now - self.started_at}
            self.metrics.append(row)
            for callback in self.on_round_end:
                callback(row)
            return replies

    def _redeliverable(self, state: RoundState, agent_id: str, finished_task_id: str = "") -> AgentSlot | None:
        """The Message of a member that pulls again without having replied or said it is done with it (the task's
        delivery was lost on the way): handed out again."""
        slot = state.slots.get(agent_id)
        if slot is None or not slot.dispatched or slot.status != "pending" or slot.task_id == finished_task_id:
            return None
        return slot

    def take_reply(self, agent_id: str, request: pb.MessageReply) -> None:
        """Take ``agent_id``'s reply to its round's Message (on the loop); a Refusal when it is not due now. A reply
        that does not parse, or answers another Message, is kept as that node's error reply."""
        state = self.current
        if state is None or request.round != state.round_id:
            raise not_this_round("reply", request.round, self.round_id + 1, applied="")
        state.check_open()
        slot = state.slot_for(agent_id, request.task_id)
        if slot.status in ("accepted", "rejected"):
            raise Refusal(grpc.StatusCode.ALREADY_EXISTS, f"agent {agent_id!r} already replied in round "
                                                         f"{state.round_id}; duplicates are refused")
        sent = self._messages[agent_id]
        try:
            reply = decode_message(request.message, self.config.max_model_bytes)
            if reply.metadata.reply_to_message_id != sent.metadata.message_id:
                raise FlowerWireError(f"it answers message {reply.metadata.reply_to_message_id!r}, not "
                                      f"{sent.metadata.message_id!r}")
            check_finite(reply)
        except FlowerWireError as exc:
            self._replies[agent_id] = error_reply(sent, f"fedpar refused the reply of {agent_id}: {exc}")
            state.reject(slot, str(exc))
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"reply refused: {exc}", final=True) from None
        self._replies[agent_id] = reply
        slot.upload_bytes = len(request.message)
        state.count_accepted(slot)
        state.close_if_done()


def check_finite(reply) -> None:
    """FlowerWireError naming the first array of ``reply``'s ArrayRecords that holds NaN or Inf."""
    if reply.has_error():
        return
    for record_name, record in reply.content.array_records.items():
        for name, array in record.items():
            values = array.numpy()
            if values.dtype.kind in "fc" and not all_finite(values):
                raise FlowerWireError(f"its array {name!r} (ArrayRecord {record_name!r}) holds NaN or Inf (did its "
                                      "training diverge? lower the ClientApp's learning rate)")


def exchange_status(replies, sent: int) -> str:
    """A Flower round's status: "ok" when some node answered with content (or nothing was sent), "failed" when every
    reply is an error (the ClientApps raised, or fedpar refused what they sent) or none came."""
    return "ok" if sent == 0 or any(not reply.has_error() for reply in replies) else "failed"


async def on_daemon_thread(fn: Callable, *args):
    """``fn(*args)`` on a daemon thread of its own: a ServerApp still waiting when the run stops (on a round the stop
    cancelled, in its own sleep) cannot be interrupted, and must not keep the coordinator's loop from closing nor the
    process from exiting, as a thread of the loop's executor would (it waited for it for ever)."""
    loop = asyncio.get_running_loop()
    result = loop.create_future()

    def settle(value, error) -> None:
        if result.done():  # cancelled: the run stopped
            return
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(value)

    def run() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as exc:  # handed to the loop, which raises it in run()
            value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: the run stopped, nobody waits for it
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=run, name="fedpar-serverapp", daemon=True).start()
    return await result


def sent_model(arrays) -> tuple[list[str], list[np.ndarray]]:
    """The (names, arrays) of a Flower ArrayRecord."""
    return list(arrays.keys()), [np.ascontiguousarray(a) for a in arrays.to_numpy_ndarrays()]


def error_reply(message, reason: str):
    """Flower's error reply to ``message`` (what a SuperLink makes of a reply it cannot deliver)."""
    from flwr.app import Error
    from flwr.app import Message

    return Message(Error(code=3, reason=reason), reply_to=message)  # ErrorCode.MESSAGE_UNAVAILABLE


def agents_by_node(agent_ids: Sequence[str]) -> dict[int, str]:
    """Each agent's Flower node id (protocol/flower_wire.py), mapped back to the agent."""
    return {node_id_of(a): a for a in agent_ids}
