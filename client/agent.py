"""The deployed agent: the client runtime (client/runtime.py) hosting one member, itself, whose data lives in its
trainer."""

from __future__ import annotations

import random

from fedpar.client.connection import AgentConfig
from fedpar.client.reconnect import FatalAgentError
from fedpar.client.runtime import ClientRuntime
from fedpar.protocol import fedpar_pb2 as pb

__all__ = ["Agent", "AgentConfig", "FatalAgentError", "OwnMember"]


class OwnMember:
    """The one member of a deployed agent: its id is the agent's, its data is in ``trainer``; it vanishes from a
    round with ``drop_probability`` (simulations of unreliable devices), drawn from ``seed``."""

    population = False

    def __init__(self, agent_id: str, trainer, drop_probability: float = 0.0, seed: int | None = None):
        self.agent_id, self.trainer, self.drop_probability = agent_id, trainer, drop_probability
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return 1

    def member_id(self, i: int) -> str:
        """The agent's id."""
        return self.agent_id

    def seat_trainers(self, seats: int) -> list:
        """Its own trainer (one seat)."""
        return [self.trainer]

    def assign(self, trainer, i: int, task: pb.TrainTask) -> None:
        """Nothing: the trainer holds the agent's data already."""

    def vanishes(self, i: int, round_id: int) -> bool:
        """A drop-out draw (never, unless ``drop_probability``)."""
        return bool(self.drop_probability) and self._rng.random() < self.drop_probability


class Agent(ClientRuntime):
    """One federated participant: the client runtime hosting one member, itself, training with ``trainer`` (a
    :class:`~fedpar.client.task_trainer.TaskTrainer`, or any trainer ClientRuntime accepts)."""

    def __init__(self, config: AgentConfig, trainer):
        super().__init__(config, OwnMember(config.agent_id, trainer, config.drop_probability, config.seed))
        self.trainer = trainer
