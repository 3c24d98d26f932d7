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
