"""Virtual clients: only the sampled clients of a round get a model and their data, through the real coordinator.
The same federation run with one agent per client and with virtual clients learns the same models, and a
population far larger than the cohort runs in worker processes that hold no agent per client."""

from __future__ import annotations

import pytest

from fedpar.simulations.runner import SimulationConfig, run_simulation


def _rows(**kw):
    rows = []
    summary = run_simulation(SimulationConfig(**kw), on_round=rows.append)
    return summary, rows


def test_virtual_clients_learn_what_one_agent_per_client_learns(tmp_path):
    common = dict(clients=20, clients_per_round=6, rounds=3, local_epochs=1, seed=3, slow_fraction=0.2,
                  slow_step_delay=0.0)
    _, agents = _rows(**common, out=str(tmp_path / "agents"))
    summary, virtual = _rows(**common, virtual_clients=True, seats=3, out=str(tmp_path / "virtual"))
    assert summary["failed_rounds"] == 0
    for a, v in zip(agents, virtual):  # the same cohorts, data, seeds and training: the same rounds
        assert (a["sampled"], a["reported"]) == (v["sampled"], v["reported"]) == (6, 6)
        assert v["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
        assert v["test_accuracy"] == pytest.approx(a["test_accuracy"], abs=1e-9)


def test_a_population_of_1400_runs_with_a_cohort_of_30(tmp_path):
    summary, rows = _rows(clients=1400, clients_per_round=30, rounds=3, local_epochs=1, val_fraction=0.0,
                          virtual_clients=True, out=str(tmp_path / "run"))
    assert summary["failed_rounds"] == 0 and [r["reported"] for r in rows] == [30, 30, 30]
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] - 0.05
    assert (tmp_path / "run" / "labels.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # label heat map
    assert 1.0 <= summary["label_skew"]["mean_classes_per_client"] <= 1.1  # about one example each


def test_settings_virtual_clients_cannot_honour_are_refused_before_anything_starts():
    for extra, says in ((dict(tls=True), "--tls"), (dict(secure_aggregation=True), "--secure-aggregation"),
                        (dict(compression="topk"), "topk"), (dict(seats=0), "--seats")):
        with pytest.raises(ValueError, match=says):
            run_simulation(SimulationConfig(clients=4, rounds=1, virtual_clients=True, **extra))
