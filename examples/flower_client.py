"""A Flower client, written for Flower only, run as a fedpar agent (README "Flower users").

    fedpar serve --insecure --port 50051 --model mlp --dataset digits --min-available 2 --clients-per-round 2
    fedpar client --insecure --server 127.0.0.1:50051 --agent-id a --num-partitions 2 --partition-index 0 \
        --model mlp --flower-client examples/flower_client.py:client_fn
    (and a second client with --agent-id b --partition-index 1)

The same file runs under Flower (``flwr run`` with ``app``). Its network has the shapes of fedpar's ``mlp`` on the
digits (64 -> 128 -> 10), so the coordinator's model and central evaluation fit it.
"""

import time

import numpy as np
import torch
from flwr.client import ClientApp, NumPyClient
from flwr.common import Context
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn


def load_partition(partition_id: int, num_partitions: int):
    """This client's IID share of the digits' training split, and the shared test split (pixels scaled to [0, 1])."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    share = np.array_split(np.random.default_rng(0).permutation(len(y_train)), num_partitions)[partition_id]
    return (torch.from_numpy(x_train[share]), torch.from_numpy(y_train[share])), \
        (torch.from_numpy(x_test), torch.from_numpy(y_test))


class DigitsClient(NumPyClient):
    """Flower's quickstart pattern: a torch network whose state_dict travels as NumPy arrays."""

    def __init__(self, train, test):
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.train, self.test = train, test

    def get_parameters(self, config):
        return [v.detach().cpu().numpy() for v in self.net.state_dict().values()]

    def set_parameters(self, parameters):
        keys = self.net.state_dict().keys()
        self.net.load_state_dict({k: torch.from_numpy(np.copy(v)) for k, v in zip(keys, parameters)})

    def fit(self, parameters, config):
        self.set_parameters(parameters)
        stop = time.monotonic() + float(config.get("deadline_seconds", float("inf")))
        optimizer = torch.optim.SGD(self.net.parameters(), lr=float(config.get("learning_rate", 0.1)))
        x, y = self.train
        losses = []
        for _ in range(int(config.get("local_epochs", 1))):
            for idx in torch.randperm(len(y)).split(int(config.get("batch_size", 32))):
                if time.monotonic() > stop:  # the agent must upload before its deadline
                    break
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(self.net(x[idx]), y[idx])
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        return self.get_parameters({}), len(y), {"train_loss": float(np.mean(losses)) if losses else 0.0}

    def evaluate(self, parameters, config):
        self.set_parameters(parameters)
        x, y = self.test
        with torch.no_grad():
            logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y).item()
        accuracy = (logits.argmax(1) == y).float().mean().item()
        return loss, len(y), {"accuracy": accuracy}

    def get_properties(self, config):
        return {"num_examples": len(self.train[1])}


def client_fn(context: Context):
    """Flower's client function: this node's partition comes from its node_config."""
    train, test = load_partition(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    return DigitsClient(train, test).to_client()


app = ClientApp(client_fn=client_fn)
