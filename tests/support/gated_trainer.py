"""A real agent's trainer that trains only once the test opens its gate (to hold an agent back mid-round)."""

from __future__ import annotations

import threading

from fedpar.client.trainer import LocalTrainer


class GatedTrainer(LocalTrainer):
    """Trains only once the test says so."""

    def __init__(self, *args, gate: threading.Event, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = gate

    def train(self, *args, **kwargs):
        """Wait for the gate, then train."""
        assert self.gate.wait(20)
        return super().train(*args, **kwargs)
