"""Virtual clients, every simulation's route: only the sampled clients of a round get a model and their data,
through the real coordinator. The same federation hosted by one process on one seat and by two processes on two
seats each learns the same models, and a population far larger than the cohort runs in worker processes that hold
no agent per client."""

from __future__ import annotations

import numpy as np
import pytest

from fedpar.protocol.compressed_wire import CompressionConfig
from fedpar.simulations.runner import SimulationConfig, run_simulation
from support.simulation_runs import simulate_rows as _rows


def test_how_the_population_is_hosted_changes_nothing_it_learns_each_client_keeps_its_error_feedback(tmp_path):
    # 6 of 12 clients a round for 4 rounds with top-k uploads: most clients are sampled more than once, and each must
    # pick up its own error-feedback residual where it left it (the host keeps them on disk, a seat carries one)
    # (federated evaluation in every 2nd round only: the agents score the global model in rounds 2 and 4)
    # On the CPU: a GPU's batched kernels round differently for stacks of other sizes, enough to move one test example.
    common = dict(clients=12, clients_per_round=6, rounds=4, local_epochs=1, seed=4, slow_fraction=0.2,
                  slow_step_delay=0.0, upload_compression=CompressionConfig("topk", 0.05), client_eval_every=2,
                  device="cpu")
    _, agents = _rows(**common, workers=1, seats=1, out=str(tmp_path / "one-seat"))  # one member after another
    summary, virtual = _rows(**common, workers=2, seats=2, out=str(tmp_path / "virtual"))
    assert summary["failed_rounds"] == 0
    for a, v in zip(agents, virtual):  # the same cohorts, data, seeds, training and residuals: the same rounds
        assert (a["sampled"], a["reported"]) == (v["sampled"], v["reported"]) == (6, 6)
        assert v["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
        assert v["test_accuracy"] == pytest.approx(a["test_accuracy"], abs=1e-9)
        assert v["upload_bytes"] == a["upload_bytes"]
        assert ("federated_eval_accuracy" in v) == ("federated_eval_accuracy" in a) == (v["round"] % 2 == 0)


def test_a_residual_store_keeps_each_clients_residual_on_disk(tmp_path):
    import numpy as np

    from fedpar.client.member_state import ResidualStore

    store = ResidualStore([(2, 3), (4,)], tmp_path / "res")
    assert store.load("c1") is None
    store.save("c1", [np.full((2, 3), 1.5, np.float32), np.arange(4, dtype=np.float32)])
    store.save("c2", [np.zeros((2, 3), np.float32), np.ones(4, np.float32)])
    got = store.load("c1")
    assert [g.shape for g in got] == [(2, 3), (4,)] and got[0][1, 2] == 1.5 and got[1].tolist() == [0, 1, 2, 3]
    store.save("c2", None)
    assert store.load("c2") is None and len(store) == 1
    with pytest.raises(ValueError, match="holds 10 values"):
        ResidualStore([(3,)], tmp_path / "res").load("c1")


def test_a_residual_store_makes_its_temporary_folder_at_the_first_save_and_close_removes_it():
    import numpy as np

    from fedpar.client.member_state import ResidualStore

    store = ResidualStore([(2,)])
    assert store.load("c1") is None and store.folder is None  # nothing kept: nothing on disk
    store.close()
    store = ResidualStore([(2,)])
    store.save("c1", [np.ones(2, np.float32)])
    folder = store.folder
    assert folder.is_dir() and store.load("c1")[0].tolist() == [1.0, 1.0]
    store.close()
    assert not folder.exists()


def test_a_population_of_1400_runs_with_a_cohort_of_30(tmp_path):
    summary, rows = _rows(clients=1400, clients_per_round=30, rounds=3, local_epochs=1, val_fraction=0.0,
                          out=str(tmp_path / "run"))
    assert summary["failed_rounds"] == 0 and [r["reported"] for r in rows] == [30, 30, 30]
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] - 0.05
    assert (tmp_path / "run" / "labels.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # label heat map
    assert 1.0 <= summary["label_skew"]["mean_classes_per_client"] <= 1.1  # about one example each


def test_a_host_without_seats_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="--seats must be >= 1"):
        run_simulation(SimulationConfig(clients=4, rounds=1, seats=0))


def test_a_worker_keeps_its_recent_members_data_within_a_byte_budget(monkeypatch):
    """A member sampled again gets the same data without its share being made again; beyond the budget the least
    recent members' data is let go."""
    from fedpar.datasets import load_dataset
    from fedpar.simulations import population
    from fedpar.tasks.zoo import classifier_for
    from fedpar.task import Partition

    splits = load_dataset("digits", None)
    task = classifier_for("mlp", splits, "digits", None)
    made = []
    client_data = task.client_data
    task.client_data = lambda p: made.append(p.index) or client_data(p)
    members = population.PopulationMembers(
        population.PopulationSlice.of("host-0", np.arange(3), np.full(3, 100), np.zeros(3, np.float32)), task,
        lambda i, agent_id: Partition(i, 10, agent_id, "iid", 0, 0.1), seed=0)
    first = members.member_data(1)
    assert members.member_data(1) is first and made == [1]
    one = population._data_bytes(first)
    monkeypatch.setattr(population, "MEMBER_DATA_CACHE_BYTES", 2 * one)
    members.member_data(0), members.member_data(2)  # three members' data: member 1's, the least recent, goes
    assert members._data_bytes <= 2 * one
    members.member_data(1)
    assert made == [1, 0, 2, 1]
    assert np.array_equal(members.member_data(1).train.x, first.train.x)
