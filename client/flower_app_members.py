"""Members that answer a Flower App's Messages (``--flower-app DIR`` without ``--strategy``: the app's ServerApp
drives, server/flower_rounds.py). The client runtime (client/runtime.py) hands each member the Message its task
carried; the member calls the app's ClientApp on it as Flower's SuperNode does, ``app(message, context)``, with
the member's Context (client/flower_app_member.py: node id, ``partition-id`` / ``num-partitions``, run config, a
``state`` kept across its rounds), and returns the reply serialized with Flower's serde. A handler that raises, or a
reply that is not a reply to that Message, becomes Flower's error reply with the reason (the run goes on)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Sequence

import numpy as np

from fedpar.client.flower_app_member import MemberStates, member_context
from fedpar.protocol.flower_wire import FlowerWireError, decode_message, encode_message

log = logging.getLogger("fedpar.client")
ERROR_CODE = 2  # flwr.common.constant.ErrorCode.CLIENT_APP_RAISED_EXCEPTION, as Flower's SuperNode replies


class MessageSeat:
    """A seat of a Flower App's members: the ClientApp holds what it trains, so a seat holds nothing."""

    framework = "flower-app"

    def __init__(self, num_examples: int = 1):
        self.num_examples = num_examples

    def warm_up(self) -> None:
        """Nothing to warm up."""

    def holding_task(self, round_id: int) -> contextlib.AbstractContextManager:
        """Nothing to hold."""
        return contextlib.nullcontext()


class FlowerAppMembers:
    """Members ``member_ids`` (partitions ``partition_ids`` of ``num_partitions``) of a Flower App's run, answering
    its Messages with ``client_app`` under ``run_config``; ``train_sizes``: the examples each declares when it joins.
    ``population``: a simulation host's slice (HostLink); else one deployed agent (AgentLink)."""

    def __init__(self, client_app: Any, run_config: dict[str, Any], member_ids: Sequence[str],
                 partition_ids: Sequence[int], num_partitions: int, train_sizes: Sequence[int] | None = None,
                 population: bool = True, states: MemberStates | None = None, trainer=None):
        self.app, self.run_config = client_app, dict(run_config)
        # A deployed agent may also train the ClientApp under fedpar's strategies (client/flower_app_member.py):
        # ``trainer`` is then its seat, whose model layout its weight tasks need; else the seats hold nothing.
        self.trainer = trainer
        self.answers_messages = trainer is None
        self.ids, self.partitions, self.num_partitions = list(member_ids), list(partition_ids), int(num_partitions)
        self.sizes = list(train_sizes) if train_sizes is not None else [1] * len(self.ids)
        self.population = population
        self.states = states if states is not None else trainer.states if trainer is not None else MemberStates()
        self._index = {m: i for i, m in enumerate(self.ids)}

    def __len__(self) -> int:
        return len(self.ids)

    def member_id(self, i: int) -> str:
        """Member ``i``'s client id."""
        return self.ids[i]

    def index_of(self, member: str) -> int:
        """The index of member ``member`` (KeyError for one this host does not hold)."""
        return self._index[member]

    def train_size(self, i: int) -> int:
        """The examples member ``i`` declares."""
        return int(self.sizes[i])

    def seat_trainers(self, seats: int) -> list:
        """Seats that hold nothing (the ClientApp trains)."""
        if self.trainer is not None:
            return [self.trainer]
        return [MessageSeat(self.train_size(0) if self.ids else 1) for _ in range(max(1, seats))]

    def assign(self, trainer, i: int, task) -> None:
        """Nothing: the member's Context is made when it answers."""

    def vanishes(self, i: int, round_id: int) -> bool:
        """Never (a Flower App's ServerApp decides who takes part)."""
        return False

    def away_now(self) -> np.ndarray:
        """Nobody is away."""
        return np.zeros(len(self.ids), bool)

    def availability_changes(self, clock_seconds: float | None) -> tuple[list[str], list[str]]:
        """None."""
        return [], []

    def finish_estimate(self, i: int, task) -> float:
        """No virtual clock for a Flower App's rounds (refused before the run starts)."""
        return 0.0

    def answer(self, i: int, data: bytes, max_bytes: int) -> bytes:
        """Member ``i``'s reply to the Flower Message in ``data``, serialized (an error reply when it has none)."""
        from flwr.app import Error, Message

        member = self.ids[i]
        try:
            message = decode_message(data, max_bytes)
        except FlowerWireError as exc:  # the coordinator's bytes: nothing to reply to
            log.warning("%s: the task's Flower Message cannot be read: %s", member, exc)
            raise
        context = member_context(member, self.partitions[i], self.num_partitions, self.run_config,
                                 self.states.of(member), message.metadata.run_id)
        try:
            reply = self.app(message, context)
            if not isinstance(reply, Message):
                raise TypeError(f"the ClientApp returned a {type(reply).__name__}, not a flwr.app.Message")
            if reply.metadata.reply_to_message_id != message.metadata.message_id:
                raise ValueError("the ClientApp's reply does not answer the message it was given (make it with "
                                 "Message(content, reply_to=msg))")
        except Exception as exc:  # the app's own failure: Flower's SuperNode replies with an error, so do we
            reason = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
            log.warning("%s: ClientApp %s handler failed: %s", member, message.metadata.message_type, reason)
            reply = Message(Error(code=ERROR_CODE, reason=f"ClientApp of {member} failed: {reason}"), reply_to=message)
        return encode_message(reply)
