"""Rank 0's commands to the other ranks of a large-model agent: small tensors broadcast over torch.distributed.

No pickle and no object collectives: a command is a fixed-size float64 vector, a per-step decision one int.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

TRAIN, SHUTDOWN = 1, 2
_FIELDS = 7  # kind, epochs, batch_size, lr, proximal_mu, round_id, max_steps


@dataclass(frozen=True)
class Command:
    """What rank 0 asks every rank to do next (``kind`` is TRAIN or SHUTDOWN)."""

    kind: int
    epochs: int = 0
    batch_size: int = 0
    lr: float = 0.0
    proximal_mu: float = 0.0
    round_id: int = 0
    max_steps: int = 0  # 0: no limit but the epochs


class ControlChannel:
    """Broadcasts from rank 0: commands on an idle-tolerant gloo group, step decisions on the training group.

    Between tasks the other ranks wait for rank 0's next command as long as the agent waits for the
    coordinator, so that wait gets its own group with a long timeout; the training group keeps its short one.
    """

    def __init__(self, device: torch.device, idle_timeout_seconds: float) -> None:
        """Create the command group (collective: every rank of the default group must call this)."""
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=idle_timeout_seconds))
        self._device = device

    def send(self, command: Command) -> None:
        """Rank 0: hand ``command`` to every rank."""
        self._broadcast(torch.tensor([command.kind, command.epochs, command.batch_size, command.lr,
                                      command.proximal_mu, command.round_id, command.max_steps],
                                     dtype=torch.float64))

    def receive(self) -> Command:
        """Other ranks: wait for rank 0's next command."""
        t = self._broadcast(torch.zeros(_FIELDS, dtype=torch.float64))
        kind, epochs, batch_size, lr, mu, round_id, max_steps = t.tolist()
        return Command(int(kind), int(epochs), int(batch_size), lr, mu, int(round_id), int(max_steps))

    def decide(self, go: bool) -> bool:
        """Every rank: rank 0's ``go`` (the others' argument is ignored), so all ranks stop at the same step."""
        flag = torch.tensor([1 if go else 0], dtype=torch.int32, device=self._device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=0, group=self._group)
        return t
