"""The local-training knobs every task carries (epochs, batch size, learning rate), declared once: the coordinator's
settings and the simulation's share these fields, so ``serve`` and ``simulate`` have the same defaults."""

from __future__ import annotations

from dataclasses import dataclass

from fedpar.settings import setting


@dataclass
class LocalTraining:
    """What an agent does with a task: E local epochs of SGD over batches of B at learning rate lr."""

    local_epochs: int = setting(5, check="count", group="training", help="local epochs per task (E)")
    batch_size: int = setting(16, check="count", group="training", help="local batch size (B)")
    learning_rate: float = setting(0.1, check="positive", flag="lr", group="training",
                                   help="local SGD learning rate")
    client_eval_every: int = setting(
        1, check="non_negative_int", group="training",
        help="agents score the received global model on their validation split (federated evaluation) in every "
             "N-th round; 0: never (the central evaluation is kept)")

    def evaluates_in(self, round_id: int) -> bool:
        """Whether the agents of round ``round_id`` evaluate the global model they receive."""
        return self.client_eval_every > 0 and round_id % self.client_eval_every == 0
