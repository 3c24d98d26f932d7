"""Virtual clients, every simulation's route: only the sampled clients of a round get a model and their data,
through the real coordinator. The same federation hosted by one process on one seat and by two processes on two
seats each learns the same models, and a population far larger than the cohort runs in worker processes that hold
no agent per client."""

from __future__ import annotations

import shutil

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


def test_a_residual_stores_first_saves_from_several_seats_at_once_share_one_folder(monkeypatch):
    # A host's seats save their members' residuals at once at the end of round 1. Each first save made a folder of its
    # own and the last one kept it, so a member whose residual went to another came back in round 2 to no file (its
    # task raised FileNotFoundError, and its round waited out the deadline). mkdtemp made slow widens that window.
    import tempfile
    import threading
    import time

    from fedpar.client.member_state import ResidualStore

    made = []
    mkdtemp = tempfile.mkdtemp

    def slow_mkdtemp(*args, **kwargs):
        time.sleep(0.05)
        made.append(mkdtemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", slow_mkdtemp)
    store = ResidualStore([(2,)])
    start = threading.Barrier(4)

    def save(client: str) -> None:
        start.wait()
        store.save(client, [np.full(2, float(client[-1]), np.float32)])

    seats = [threading.Thread(target=save, args=(f"c{i}",)) for i in range(4)]
    for seat in seats:
        seat.start()
    for seat in seats:
        seat.join()
    try:
        assert len(made) == 1
        assert [store.load(f"c{i}")[0].tolist() for i in range(4)] == [[float(i)] * 2 for i in range(4)]
    finally:
        store.close()
        for folder in made[1:]:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.timeout(120)
def test_a_member_whose_task_fails_past_its_stages_own_checks_is_told_to_the_coordinator_at_once(caplog):
    # A member's task that raises where no stage expects it (here: its top-k residual on the host's disk is not the
    # model's size) fails that task alone, and the coordinator hears at once: the round closes on the others instead
    # of waiting out its 60 s deadline for an update that will not come.
    import logging

    from fedpar.simulations.population import host_population
    from support.population_host import digits_population

    rows: list[dict] = []
    with digits_population(4, rows, rounds=1, clients_per_round=4, local_epochs=1,
                           upload_compression=CompressionConfig("topk")) as (worker, task):
        host = host_population(worker.server, worker.population, task, worker.partition_of, 0, seats=2,
                               poll_seconds=1.0)
        host.residuals.save(host.members.member_id(3), [np.zeros(3, np.float32)])
        with caplog.at_level(logging.INFO, logger="fedpar.server"):
            host.run()  # until the coordinator says training is over
    assert [(r["status"], r["reported"], r["rejected"]) for r in rows] == [("ok", 3, 1)]
    assert rows[0]["round_seconds"] < 20.0
    said = [r.getMessage() for r in caplog.records if "answered with no update" in r.getMessage()]
    assert len(said) == 1 and "agent failed: ValueError" in said[0] and "holds 3 values" in said[0], said


def test_a_residual_that_cannot_be_written_is_forgotten_and_said_to_be(tmp_path):
    # A full disk (a file-size limit on this process: writes past it fail with EFBIG, as with ENOSPC; Python ignores
    # SIGXFSZ) or a folder that went away: the save fails in one named error, leaves no partial file, and the
    # client's older residual is not read back in its place.
    import resource

    from fedpar.client.member_state import ResidualNotKept, ResidualStore

    store = ResidualStore([(1024,)], folder=tmp_path / "residuals")
    store.save("c1", [np.ones(1024, np.float32)])
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limits[1]))
    try:
        with pytest.raises(ResidualNotKept, match=r"cannot keep c1's residual in .*residuals: .*"
                                                    r"(File too large|the disk full)"):
            store.save("c1", [np.full(1024, 2.0, np.float32)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert store.load("c1") is None and len(store) == 0
    assert sorted(p.name for p in (tmp_path / "residuals").iterdir()) == []
    shutil.rmtree(tmp_path / "residuals")
    (tmp_path / "residuals").write_text("")  # the folder is a file now
    with pytest.raises(ResidualNotKept, match="cannot keep c2's residual"):
        store.save("c2", [np.ones(1024, np.float32)])


@pytest.mark.timeout(120)
def test_members_whose_residuals_cannot_be_kept_still_count_and_the_host_says_so_once_a_round(tmp_path, caplog):
    # Each member's failed save was an "agent failed" error with its traceback, once per member and round, and the
    # coordinator was told its update failed after it had counted it.
    import logging

    from fedpar.simulations.population import host_population
    from support.population_host import digits_population

    rows: list[dict] = []
    with digits_population(4, rows, rounds=2, clients_per_round=4, local_epochs=1,
                           upload_compression=CompressionConfig("topk")) as (worker, task):
        host = host_population(worker.server, worker.population, task, worker.partition_of, 0, seats=2,
                               poll_seconds=1.0)
        host.residuals.folder = tmp_path / "not-a-folder"  # where the host keeps them: a file, not a folder
        host.residuals.folder.write_text("")
        with caplog.at_level(logging.INFO, logger="fedpar.client"):  # (an earlier test may have set its level)
            host.run()  # until the coordinator says training is over
    assert [(r["status"], r["reported"], r["rejected"]) for r in rows] == [("ok", 4, 0)] * 2
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "residuals" in r.getMessage()]
    assert len(said) == 2 and all("cannot be kept" in line and "Not a directory" in line for line in said), said
    assert "round 1" in said[0] and "round 2" in said[1]
    each = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "error feedback starts" in
            r.getMessage()]
    assert len(each) == 8, each


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
