"""Real agents (client/agent.py) training an MLP on their IID share of the digits, in daemon threads: the
honest federation of the kill -9 and aggregator-rank tests."""

from __future__ import annotations

import threading
from typing import Callable

import torch

from fedpar.client.agent import Agent, AgentConfig
from fedpar.client.trainer import LocalTrainer
from fedpar.datasets import load_dataset
from fedpar.datasets.clientdata import local_split, partition_indices
from fedpar.models.for_data import build_model_for_data


def start_digit_agents(port: int, ids: list[str], give_up_after: float = 60.0,
                       trainer: Callable[..., LocalTrainer] | None = None
                       ) -> tuple[list[Agent], list[threading.Thread], list[BaseException]]:
    """One real agent per id against 127.0.0.1:``port``, each running in a daemon thread; they re-join by
    themselves. ``trainer(agent_id, model, train, val, seed=i)`` builds each one's trainer (default: LocalTrainer).
    Returns the agents, their threads and a list that collects what any of them raised."""
    splits = load_dataset("digits")
    parts = partition_indices(splits, "iid", len(ids), 0)
    agents = []
    for i, agent_id in enumerate(ids):
        train, val = local_split(splits.train, parts[i], 0.1, 0)
        torch.manual_seed(0)
        model = build_model_for_data("mlp", splits.input_shape, splits.num_classes)
        local = (trainer(agent_id, model, train, val, seed=i) if trainer is not None
                 else LocalTrainer(model, train, val, seed=i))
        agents.append(Agent(AgentConfig(insecure=True, server=f"127.0.0.1:{port}", agent_id=agent_id, poll_seconds=1.0,
                                        initial_backoff=0.05, max_backoff=0.3, give_up_after=give_up_after), local))
    return agents, *run_in_threads(agents)


def run_in_threads(agents: list[Agent]) -> tuple[list[threading.Thread], list[BaseException]]:
    """Run each agent in a daemon thread; the threads, and a list that collects what any of them raised."""
    errors: list[BaseException] = []

    def run(agent):
        try:
            agent.run()
        except BaseException as exc:  # surfaced by the test
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(a,), daemon=True) for a in agents]
    for t in threads:
        t.start()
    return threads, errors
