"""The model and data of the tiny app: y = x @ w + b fitted by full-batch gradient steps (deterministic)."""

from __future__ import annotations

import numpy as np

FEATURES = 4


def initial_arrays() -> dict[str, np.ndarray]:
    """The global model the ServerApp starts from."""
    rng = np.random.default_rng(0)
    return {"w": rng.normal(size=(FEATURES, 1)).astype(np.float32), "b": np.zeros(1, np.float32)}


def partition(partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Partition ``partition_id``'s data: 8 + partition_id examples (so the FedAvg weights differ)."""
    rng = np.random.default_rng(100 + partition_id)
    x = rng.normal(size=(8 + partition_id, FEATURES)).astype(np.float32)
    w = np.full((FEATURES, 1), 1.0 + partition_id, np.float32)
    return x, (x @ w + 0.5).astype(np.float32)


def train(arrays: dict[str, np.ndarray], partition_id: int, lr: float, steps: int) -> tuple[dict, float, int]:
    """``steps`` full-batch gradient steps on the partition; the new arrays, the last loss, the examples."""
    x, y = partition(partition_id)
    w, b = arrays["w"].copy(), arrays["b"].copy()
    loss = 0.0
    for _ in range(steps):
        err = x @ w + b - y
        loss = float((err ** 2).mean())
        w -= lr * (2 * x.T @ err / len(y)).astype(np.float32)
        b -= lr * (2 * err.mean(axis=0)).astype(np.float32)
    return {"w": w, "b": b}, loss, len(y)


def loss_of(arrays: dict[str, np.ndarray], partition_id: int) -> tuple[float, int]:
    """The mean squared error of ``arrays`` on the partition, and its examples."""
    x, y = partition(partition_id)
    return float(((x @ arrays["w"] + arrays["b"] - y) ** 2).mean()), len(y)
