"""digits-app: the ServerApp (Flower's Message API)."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from digits_app.task import Net, load_centralized_test
from digits_app.task import test as test_fn

app = ServerApp()


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """The global model on the held-out test split."""
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    loss, accuracy = test_fn(model, load_centralized_test())
    return MetricRecord({"loss": loss, "accuracy": accuracy})


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Federated averaging for num-server-rounds rounds, from a model drawn with seed 0."""
    torch.manual_seed(0)
    arrays = ArrayRecord(Net().state_dict())
    strategy = FedAvg(fraction_train=float(context.run_config["fraction-train"]))
    strategy.start(grid=grid, initial_arrays=arrays, num_rounds=int(context.run_config["num-server-rounds"]),
                            train_config=ConfigRecord({"lr": float(context.run_config["lr"])}),
                            evaluate_fn=global_evaluate)
