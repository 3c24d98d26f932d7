"""A Flower strategy fedpar lacks (Flower's FedAvgM, ``--strategy flower:flwr.server.strategy:FedAvgM``) aggregates
real rounds of real agents over loopback gRPC, with fp16-compressed uploads, and gives what fedpar's own FedAvgM
gives on the same updates."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr")

from fedpar.aggregation import FedAvgM  # noqa: E402
from fedpar.aggregation.flower_strategy import FlowerStrategy, flower_class  # noqa: E402
from fedpar.datasets import load_dataset  # noqa: E402
from fedpar.protocol.compressed_wire import CompressionConfig  # noqa: E402
from fedpar.server.assembly import CoordinatorAssembly  # noqa: E402
from fedpar.server.checkpoint import load_checkpoint  # noqa: E402
from fedpar.server.config import CoordinatorConfig  # noqa: E402
from support.digit_agents import start_digit_agents  # noqa: E402

NAME = "flower:flwr.server.strategy:FedAvgM"


class Recording(FlowerStrategy):
    """The adapter, keeping a copy of every update it is given (the coordinator's staging buffers are reused)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cohorts: dict[int, list] = {}

    def fold(self, update, num_examples, client_id="", members=(), *, known_finite=False):
        super().fold(update, num_examples, client_id, members, known_finite=known_finite)
        with self._lock:
            self.cohorts.setdefault(self.round_id, []).append(([np.array(a) for a in update], num_examples))


def test_flower_fedavgm_runs_real_rounds_over_grpc_and_matches_fedpars_fedavgm(tmp_path):
    assembly = CoordinatorAssembly.for_data("mlp", load_dataset("digits"), 0, "cpu")
    strategy = Recording(flower_class(NAME), name=NAME, server_momentum=0.5, server_learning_rate=1.0)
    rows = []
    config = CoordinatorConfig(rounds=2, overselect=1.0, deadline_seconds=30.0, heartbeat_seconds=1.0,
                               liveness_timeout_seconds=10.0, min_available=2, clients_per_round=2, local_epochs=1,
                               batch_size=32, learning_rate=0.1, upload_compression=CompressionConfig("fp16"),
                               checkpoint_dir=tmp_path / "ckpt")
    server = assembly.server(config, strategy, on_round_end=[rows.append])
    server.start()
    try:
        agents, threads, errors = start_digit_agents(server.port, ["ma", "mb"], give_up_after=30)
        assert server.wait(90)
        for t in threads:
            t.join(30)
    finally:
        server.stop()
    assert not errors
    assert [r["status"] for r in rows] == ["ok", "ok"] and all(r["num_updates"] == 2 for r in rows)
    assert rows[-1]["test_accuracy"] > 0.5
    ours, g = FedAvgM(server_learning_rate=1.0, server_momentum=0.5), assembly.weights
    for r in (1, 2):
        ours.begin_round(r, g)
        for j, (update, n) in enumerate(strategy.cohorts[r]):
            ours.fold(update, n, client_id=str(j))
        g, _ = ours.finish()
    for got, want in zip(server.coordinator.weights, g):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    saved = load_checkpoint(tmp_path / "ckpt")  # Flower's momentum is in the round's checkpoint, as arrays
    assert saved.round_id == 2 and saved.state["strategy"]["strategy"] == NAME
    for i, momentum in enumerate(strategy._flower.momentum_vector):
        np.testing.assert_array_equal(saved.strategy_arrays[f"momentum_vector.{i}"], momentum)
