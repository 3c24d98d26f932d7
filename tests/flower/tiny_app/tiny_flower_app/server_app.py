"""The tiny app's ServerApp (Flower's Message API): FedAvg from fixed initial arrays."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from tiny_flower_app.task import initial_arrays

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """FedAvg on every node for num-server-rounds rounds; the final arrays saved to final-path (if set)."""
    if context.run_config.get("send-nothing", False):
        return
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=1.0, min_available_nodes=2)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord({name: Array(a) for name, a in initial_arrays().items()}),
                            num_rounds=int(context.run_config["num-server-rounds"]),
                            train_config=ConfigRecord({"lr": float(context.run_config["lr"])}), timeout=30)
    path = str(context.run_config.get("final-path", ""))
    if path:
        arrays = result.arrays
        np.savez(path, **dict(zip(arrays.keys(), arrays.to_numpy_ndarrays())))
