"""Client-side DP over real gRPC: the clip norm reaches agents, they clip, a lying agent is refused."""

from __future__ import annotations

import json
import threading

import grpc
import numpy as np
import pytest
import torch

from fedpar.aggregation import build_strategy
from fedpar.aggregation.clipping import delta_norm
from fedpar.client.privacy import privatize_update
from fedpar.datasets import load_dataset
from fedpar.models import get_weights, weight_specs
from fedpar.models.for_data import build_model_for_data
from fedpar.protocol.codec import ModelLayout
from fedpar.server.checkpoint import load_checkpoint
from fedpar.simulations.agents import AgentSpec, WorkerConfig, build_agent


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in ((20, 30), (30,))]


@pytest.mark.filterwarnings("ignore:Optimal order is the smallest alpha")
def test_client_dp_refuses_an_unclipped_update_and_completes_the_round(start_coordinator, agents, tmp_path):
    init = _weights()
    strategy = build_strategy("dp-fedavg", noise_multiplier=1e-6, clip_norm=0.5, population=3,
                              clients_per_round=3, mode="client", seed=0)
    server = start_coordinator(init, strategy=strategy, clients_per_round=3, min_available=3,
                               checkpoint_dir=tmp_path / "ckpt")
    honest_a, liar, honest_b = agents(server.address, ["a", "liar", "b"])
    layout = ModelLayout.of_arrays([f"t{i}" for i in range(len(init))], init)
    sent = []
    for bot, seed in ((honest_a, 1), (liar, 2), (honest_b, 3)):
        task = bot.task()
        extra = json.loads(task.extra_json)
        assert extra == {"dp_clip_norm": 0.5, "dp_local_noise": 0.0}
        glob = bot.download(task, layout)
        trained = _weights(seed)  # far from the global model: delta norm ~ 35
        if bot is liar:
            with pytest.raises(grpc.RpcError) as err:
                bot.upload(task, trained, 100)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "clip norm" in err.value.details()
            continue
        update = privatize_update(trained, glob, extra)
        assert delta_norm(update, glob) == pytest.approx(0.5, rel=1e-5)
        assert bot.upload(task, update, 100).accepted
        sent.append(update)
    assert server.wait(30)
    row = server.coordinator.metrics.rows[-1]
    assert (row["status"], row["reported"], row["rejected"]) == ("ok", 2, 1)
    assert row["dp_epsilon"] > 0 and row["dp_clip_norm"] == 0.5 and row["num_updates"] == 2.0
    # fixed denominator 3: the global model moved by (delta_a + delta_b) / 3, nothing of the liar's
    for i, new in enumerate(server.coordinator.weights):
        expected = init[i] + ((sent[0][i] - init[i]) + (sent[1][i] - init[i])) / 3
        np.testing.assert_allclose(new, expected, atol=1e-5)
    # the privacy history is checkpointed (JSON) and a restarted coordinator's accountant continues from it
    ckpt = load_checkpoint(tmp_path / "ckpt")
    assert ckpt.state["strategy"]["accountant"]["history"] == [[1e-6, 1.0, 1]]
    server.stop()
    fresh = build_strategy("dp-fedavg", noise_multiplier=1e-6, clip_norm=0.5, population=3,
                           clients_per_round=3, mode="client")
    start_coordinator(init, strategy=fresh, rounds=2, clients_per_round=3, min_available=3,
                      checkpoint_dir=tmp_path / "ckpt")
    assert fresh.accountant.steps == 1 and fresh.accountant.epsilon() == pytest.approx(row["dp_epsilon"])


@pytest.mark.timeout(120)
def test_real_agents_clip_to_the_adaptive_clip_norm_and_none_is_refused(start_coordinator):
    """Real Agent + LocalTrainer objects (threads in this process) train on digits under client-side DP."""
    splits = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model_for_data("mlp", splits.input_shape, splits.num_classes)
    names = [n for n, _, _ in weight_specs(model)]
    strategy = build_strategy("dp-fedavg", noise_multiplier=0.3, clip_norm=0.05, population=3,
                              clients_per_round=3, mode="client", target_quantile=0.5, count_noise=0.5,
                              seed=0)
    server = start_coordinator(get_weights(model), names=names, strategy=strategy, rounds=3,
                               clients_per_round=3, min_available=3, local_epochs=1, learning_rate=0.1)
    parts = np.array_split(np.arange(600), 3)
    worker = WorkerConfig(server.address, "digits", None, "mlp", 0.0, 0, [], poll_seconds=1.0)
    bots = [build_agent(worker, AgentSpec(f"agent-{i}", part), splits) for i, part in enumerate(parts)]
    threads = [threading.Thread(target=bot.run) for bot in bots]
    for t in threads:
        t.start()
    assert server.wait(90)
    for t in threads:
        t.join(timeout=30)
    rows = server.coordinator.metrics.rows
    assert [r["status"] for r in rows] == ["ok"] * 3
    assert all(r["reported"] == 3 and r["rejected"] == 0 for r in rows)  # every agent clipped as asked
    assert rows[0]["dp_clip_norm"] == 0.05 and rows[0]["dp_clipped_fraction"] == 1.0  # one epoch moves > 0.05
    assert rows[1]["dp_clip_norm"] > 0.05  # all clipped: the clip norm grows toward the median norm
    assert all(b.stats.accepted == 3 and not b.stats.refusals for b in bots)
