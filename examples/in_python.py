"""A federation in one Python process, without the CLI: a coordinator and two agents of a task, over real gRPC on
loopback (plaintext, asked for by name). The same parts `fedpar serve` and `fedpar client` assemble.

Run: ``.venv/bin/python examples/in_python.py`` (digits MLP, 2 agents, 3 rounds; prints each round's row).
"""

from __future__ import annotations

import threading

from fedpar import Partition
from fedpar.aggregation import FedAvg
from fedpar.client.agent import Agent, AgentConfig
from fedpar.client.task_trainer import TaskTrainer
from fedpar.server.assembly import CoordinatorAssembly
from fedpar.server.config import CoordinatorConfig
from fedpar.tasks.zoo import classifier


def run(rounds: int = 3, agents: int = 2) -> list[dict]:
    """Serve ``rounds`` of FedAvg to ``agents`` agents of the digits task; the coordinator's metrics rows."""
    task = classifier(model="mlp", dataset="digits")  # or your own fedpar.Task (docs/tutorials/your-own-task.md)
    config = CoordinatorConfig(rounds=rounds, clients_per_round=agents, min_available=agents, local_epochs=1)
    server = CoordinatorAssembly.for_task(task, seed=0, eval_device="cpu").server(config, FedAvg())
    rows: list[dict] = []  # each round's metrics row as it ends (config.metrics_path would write metrics.jsonl)
    server.coordinator.on_round_end.append(rows.append)
    server.start()  # binds 127.0.0.1 on a free port: server.address
    members, workers = [], []
    for i in range(agents):
        trainer = TaskTrainer(task, task.client_data(Partition(i, agents, client_id=f"agent-{i}")), seed=i)
        members.append(Agent(AgentConfig(server=server.address, agent_id=f"agent-{i}", insecure=True), trainer))
        workers.append(threading.Thread(target=members[-1].run))  # until the coordinator says the run is over
    for w in workers:
        w.start()
    try:
        server.wait(300)
    finally:  # finished, or interrupted (Ctrl-C): the agents leave too, else their threads keep the process alive
        for agent in members:
            agent.stop()
        server.stop()
        for w in workers:
            w.join(30)
    return rows


if __name__ == "__main__":
    for row in run():
        print({k: row[k] for k in ("round", "reported", "train_loss", "test_accuracy")})
