"""DP-FedAvg end to end: a real coordinator and 10 real agents on loopback gRPC, epsilon in every metrics row."""

from __future__ import annotations

import json

import pytest

from fedpar.protocol.compressed_wire import CompressionConfig
from fedpar.simulations.runner import SimulationConfig, run_simulation

ROUNDS = 6


@pytest.mark.timeout(300)
def test_central_dp_simulation_reports_epsilon_every_round_and_still_learns(tmp_path):
    # client-side DP with real agents: tests/server/test_dp_rounds.py (in-process, no worker start-up)
    options = dict(noise_multiplier=0.3, clip_norm=1.0, population=10, clients_per_round=10, seed=0)
    cfg = SimulationConfig(clients=10, rounds=ROUNDS, local_epochs=2, strategy="dp-fedavg",
                           strategy_options=options, workers=1, out=str(tmp_path))
    summary = run_simulation(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
    assert all(r["status"] == "ok" and r["rejected"] == 0 for r in rows)
    eps = [r["dp_epsilon"] for r in rows]
    assert all(b > a > 0 for a, b in zip(eps, eps[1:]))
    for key in ("dp_clip_norm", "dp_noise_std", "dp_clipped_fraction", "dp_delta"):
        assert all(key in r for r in rows)
    assert summary["final_dp_epsilon"] == eps[-1]
    # chance is 0.10; without DP these settings reach ~0.88 after 6 rounds, with DP ~0.87-0.89
    assert summary["final_test_accuracy"] >= 0.7


@pytest.mark.timeout(300)
def test_client_dp_counts_the_clients_clip_bits_through_lossy_compression(tmp_path):
    # Every client clips (its delta is far beyond C = 0.05), but top-k keeps a few of the clipped delta's coordinates,
    # so the update the coordinator decodes has a norm well below C. It used to count each as unclipped (fraction 0),
    # and adaptive clipping then shrank C while every client was clipping; the clients' own bits say otherwise.
    options = dict(noise_multiplier=0.3, clip_norm=0.05, population=5, clients_per_round=5, seed=0, mode="client",
                   target_quantile=0.5)
    cfg = SimulationConfig(clients=5, rounds=3, strategy="dp-fedavg", strategy_options=options, workers=1,
                           upload_compression=CompressionConfig("topk"), out=str(tmp_path))
    run_simulation(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["status"] == "ok" and r["rejected"] == 0 for r in rows)
    assert [r["dp_clipped_fraction"] for r in rows] == [1.0, 1.0, 1.0]
    clip_norms = [r["dp_clip_norm"] for r in rows]
    assert clip_norms[0] == 0.05 and all(b > a for a, b in zip(clip_norms, clip_norms[1:]))  # C grows toward them


@pytest.mark.timeout(300)
def test_client_dp_under_secure_aggregation_counts_the_clip_bits_and_learns_as_in_the_clear(tmp_path):
    # The agents clip, mask their update (weighing 1) with their clip bit after it, and the coordinator noises the
    # unmasked sum: the bits' count it sees is the count the same round's agents report in the clear.
    options = dict(noise_multiplier=0.3, clip_norm=1.7, population=10, clients_per_round=10, seed=0, mode="client",
                   target_quantile=0.5)
    rows = {}
    for how, secure in (("clear", False), ("masked", True)):
        cfg = SimulationConfig(clients=10, rounds=3, strategy="dp-fedavg", strategy_options=options, workers=1,
                               secure_aggregation=secure, out=str(tmp_path / how))
        run_simulation(cfg)
        rows[how] = [json.loads(line) for line in (tmp_path / how / "metrics.jsonl").read_text().splitlines()]
    masked, clear = rows["masked"], rows["clear"]
    assert all(r["status"] == "ok" and r["reported"] == 10 and r["num_updates"] == 10 for r in masked)
    assert not any("examples" in r for r in masked)  # hidden: each agent weighs 1, so the sum's weight is no count
    assert masked[0]["dp_clipped_fraction"] == clear[0]["dp_clipped_fraction"]  # round 1: the same training
    assert any(0 < r["dp_clipped_fraction"] < 1 for r in masked)  # (C = 1.7 clips some agents of a round, not all)
    assert [r["dp_epsilon"] for r in masked] == [r["dp_epsilon"] for r in clear]
    assert masked[1]["dp_clip_norm"] == pytest.approx(clear[1]["dp_clip_norm"])  # adaptive clipping moved C alike
    assert masked[-1]["test_accuracy"] > 0.5  # chance is 0.10
