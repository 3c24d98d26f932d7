"""The deployed agent: the client runtime (client/runtime.py) hosting one member, itself, whose data lives in its
trainer."""

from __future__ import annotations

from fedpar.client.links import AgentConfig, FatalAgentError
from fedpar.client.runtime import ClientRuntime, OwnMember

__all__ = ["Agent", "AgentConfig", "FatalAgentError", "OwnMember"]


class Agent(ClientRuntime):
    """One federated participant: the client runtime hosting one member, itself, training with ``trainer`` (a
    :class:`~fedpar.client.task_trainer.TaskTrainer`, or any trainer ClientRuntime accepts)."""

    def __init__(self, config: AgentConfig, trainer):
        super().__init__(config, OwnMember(config.agent_id, trainer, config.drop_probability, config.seed))
        self.trainer = trainer
