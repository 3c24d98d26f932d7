"""One-time data-plane transfer tickets: 256 random bits bound to an agent, a round and a task.

A ticket allows one download and one upload on the data plane, each at most once to completion and one
connection at a time; an operation that broke off gives its use back (the agent may retry this round, as
after a broken gRPC stream). Tickets expire with their round. Mutated only on the coordinator's loop.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import grpc

from fedpar.protocol.dataplane import OP_DOWNLOAD, TICKET_BYTES
from fedpar.server.rounds import Refusal

OP_NAMES = {OP_DOWNLOAD: "download"}


@dataclass
class TransferTicket:
    """What a ticket grants, and which of its operations are in progress or done."""

    agent_id: str
    round_id: int
    task_id: str
    holder: str = ""  # whose client certificate may present it: the agent's own, or its simulation host's
    ops: dict[int, str] = field(default_factory=dict)  # op -> "busy" | "used"

    def __post_init__(self) -> None:
        self.holder = self.holder or self.agent_id


class TicketBook:
    """Issues tickets with the tasks of a round and checks them when a data connection presents one."""

    def __init__(self):
        self._live: dict[bytes, TransferTicket] = {}
        self._expired: dict[bytes, int] = {}  # tickets of the previous round, for a clear refusal

    def issue(self, agent_id: str, round_id: int, task_id: str, holder: str = "") -> bytes:
        """A fresh ticket for ``agent_id``'s task in ``round_id`` (``holder``: whose certificate speaks for it,
        if not its own)."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        self.admit(ticket, agent_id, round_id, task_id, holder)
        return ticket

    def admit(self, ticket: bytes, agent_id: str, round_id: int, task_id: str, holder: str = "") -> None:
        """Honour ``ticket``, drawn elsewhere (by rank 0 for an agent dealt to this aggregator rank)."""
        if len(ticket) != TICKET_BYTES:
            raise ValueError(f"a data-plane ticket has {TICKET_BYTES} bytes, not {len(ticket)}")
        self._live[ticket] = TransferTicket(agent_id, round_id, task_id, holder)

    def expire_rounds_before(self, round_id: int) -> None:
        """Tickets of earlier rounds stop working (called when ``round_id`` starts)."""
        old = {t: e.round_id for t, e in self._live.items() if e.round_id < round_id}
        self._expired = old
        for t in old:
            del self._live[t]

    def claim(self, ticket: bytes, op: int, current_round: int | None, round_open: bool,
              peer_agent: str | None) -> TransferTicket:
        """Mark ``op`` of ``ticket`` busy, or raise Refusal saying why the ticket cannot be used."""
        entry = self._live.get(ticket)
        if entry is None:
            if ticket in self._expired:
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"data-plane ticket of round {self._expired[ticket]} has expired; pull a new task")
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED, "unknown data-plane ticket; pull a new task")
        if peer_agent is not None and peer_agent != entry.holder:
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                          f"this data-plane ticket was issued to agent {entry.holder!r}, but the client "
                          f"certificate proves {peer_agent!r}")
        if entry.round_id != current_round or not round_open:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"data-plane ticket of round {entry.round_id} has expired (the round is closed); "
                          "the update was not applied")
        name = OP_NAMES.get(op, "upload")
        state = entry.ops.get(op)
        if state == "used":
            raise Refusal(grpc.StatusCode.ALREADY_EXISTS,
                          f"data-plane ticket already used for the {name} of round {entry.round_id}")
        if state == "busy":
            raise Refusal(grpc.StatusCode.ALREADY_EXISTS,
                          f"data-plane ticket is already in use by another {name} connection")
        entry.ops[op] = "busy"
        return entry

    def release(self, entry: TransferTicket, op: int, used: bool) -> None:
        """End an operation: ``used`` spends it; otherwise (it broke off) it may be tried again."""
        if used:
            entry.ops[op] = "used"
        else:
            entry.ops.pop(op, None)
