"""FedProx end to end: the coordinator's task carries proximal_mu and the real agent trains with it."""

from __future__ import annotations

import threading

import numpy as np
import torch
from torch import nn

from fedpar.aggregation import build_strategy
from fedpar.client.agent import Agent, AgentConfig
from fedpar.client.trainer import LocalTrainer
from fedpar.datasets import ArrayDataset
from fedpar.models import get_weights, weight_specs

MU = 0.37


class RecordingTrainer(LocalTrainer):
    """The real trainer; remembers the proximal_mu of every task and the weights it produced."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mus: list[float] = []
        self.results: list[list[np.ndarray]] = []

    def train(self, epochs, batch_size, lr, stop_at=float("inf"), proximal_mu=0.0, round_id=0):
        self.mus.append(proximal_mu)
        result = super().train(epochs, batch_size, lr, stop_at, proximal_mu, round_id)
        self.results.append(get_weights(self.model))
        return result


def test_proximal_mu_reaches_the_agents_trainer_every_round(start_coordinator):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    rng = np.random.default_rng(0)
    data = ArrayDataset(rng.standard_normal((32, 4)).astype(np.float32), rng.integers(0, 3, 32))
    trainer = RecordingTrainer(model, data, seed=1)
    init = get_weights(model)
    server = start_coordinator(init, names=[n for n, _, _ in weight_specs(model)],
                               strategy=build_strategy("fedprox", proximal_mu=MU), rounds=2, clients_per_round=1,
                               min_available=1, local_epochs=1, batch_size=8, learning_rate=0.1)
    agent = Agent(AgentConfig(insecure=True,
                              server=server.address, agent_id="prox", poll_seconds=1.0, initial_backoff=0.05,
                              max_backoff=0.3, give_up_after=30, seed=0), trainer)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    assert server.wait(60)
    thread.join(30)
    assert not thread.is_alive()
    assert trainer.mus == [MU, MU]
    # One agent, FedAvg at the server: the global model is what the proximal training produced.
    for got, want in zip(server.coordinator.weights, trainer.results[-1]):
        np.testing.assert_allclose(got, want, rtol=1e-6)
