"""The FedAvg strategies: FedAvg (McMahan et al. 2017) and FedAvgM (server momentum, Hsu et al. 2019).

The same average as one plain function over a list of results is aggregation/weighted_mean.fedavg.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedpar.aggregation.accumulator import FoldConfig, cast_like
from fedpar.aggregation.catalog import register_strategy
from fedpar.aggregation.strategy import StreamingStrategy


@register_strategy
class FedAvg(StreamingStrategy):
    """New global = weighted mean of the clients' weights, weights = num_examples."""

    name = "fedavg"


@register_strategy
class FedAvgM(StreamingStrategy):
    """Server momentum on the pseudo-gradient ``g = global - average``: ``v = beta*v + g``, ``x -= lr*v``."""

    name = "fedavgm"
    memory_note = StreamingStrategy.memory_note + "; plus one momentum buffer of the model size (float32/64)"

    def __init__(self, server_learning_rate: float = 1.0, server_momentum: float = 0.9,
                 fold_config: FoldConfig | None = None) -> None:
        """Set the server step size and momentum factor."""
        super().__init__(fold_config)
        if server_learning_rate <= 0 or not 0 <= server_momentum < 1:
            raise ValueError("server_learning_rate must be > 0 and server_momentum in [0, 1)")
        self.server_learning_rate = float(server_learning_rate)
        self.server_momentum = float(server_momentum)
        self.momentum: list[np.ndarray] | None = None

    def _server_update(self, global_weights: list[np.ndarray], average: list[np.ndarray]) -> list[np.ndarray]:
        """Momentum step on the averaged pseudo-gradient."""
        assert self._acc is not None
        acc_dtypes = self._acc.acc_dtypes
        grads = [np.asarray(g, dt) - np.asarray(a, dt) for g, a, dt in zip(global_weights, average, acc_dtypes)]
        if self.momentum is None or len(self.momentum) != len(grads) or any(
                m.shape != g.shape for m, g in zip(self.momentum, grads)):
            self.momentum = grads
        else:
            self.momentum = [self.server_momentum * m + g for m, g in zip(self.momentum, grads)]
        lr = self.server_learning_rate
        return [cast_like(np.asarray(g, m.dtype) - lr * m, g.dtype)
                for g, m in zip(global_weights, self.momentum)]

    def _state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Momentum buffers and hyper-parameters."""
        arrays = {f"momentum.{i}": m for i, m in enumerate(self.momentum or [])}
        return arrays, {"server_learning_rate": self.server_learning_rate, "server_momentum": self.server_momentum,
                        "num_arrays": len(self.momentum or [])}

    def _load_state(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Restore momentum buffers."""
        n = int(meta.get("num_arrays", 0))
        self.momentum = [np.array(arrays[f"momentum.{i}"]) for i in range(n)] or None
