"""`fedpar simulate` runs every client through the task route: the zoo named by --model/--dataset and the same zoo
task named by --task learn the same federation, and a user's own task runs on two seats and two aggregator ranks as on
one seat and one coordinator process."""

from __future__ import annotations

import pytest

from support.simulation_runs import simulate_rows
from support.own_task import EXAMPLE, write_table


def _same_rounds(a_rows: list[dict], b_rows: list[dict], reported: int) -> None:
    assert len(a_rows) == len(b_rows)
    for a, b in zip(a_rows, b_rows):
        assert (a["sampled"], a["reported"]) == (b["sampled"], b["reported"]) and a["reported"] == reported
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
        assert b["test_accuracy"] == pytest.approx(a["test_accuracy"], abs=1e-9)
        assert b["federated_eval_loss"] == pytest.approx(a["federated_eval_loss"], rel=1e-5)


def test_the_zoo_by_name_and_by_task_reference_learn_the_same_federation(tmp_path):
    common = dict(clients=4, rounds=2, local_epochs=1, seed=3, workers=1, slow_fraction=0.25, slow_step_delay=0.001,
                  partition="dirichlet:0.5", plot=False)
    _, by_name = simulate_rows(**common, model="cnn", dataset="digits", seats=1, out=str(tmp_path / "name"))
    # ... by reference on two seats: the cnn's 755 KB updates ride whole in the host's upload batches
    _, by_task = simulate_rows(**common, task="fedpar.tasks.zoo:classifier", seats=2,
                               task_options={"model": "cnn", "dataset": "digits"}, out=str(tmp_path / "task"))
    _same_rounds(by_name, by_task, reported=4)


def test_a_users_task_on_two_seats_and_two_aggregator_ranks_learns_what_one_seat_and_one_process_learn(tmp_path):
    # 3 of 6 clients a round: members come back, each with its own data from the task's client_data, on 2 seats
    csv = write_table(tmp_path / "table.csv")
    common = dict(task=EXAMPLE, task_options={"csv": str(csv), "hidden": "8"}, clients=6, clients_per_round=3,
                  rounds=3, local_epochs=1, seed=5, learning_rate=0.01, workers=1, plot=False)
    _, agents = simulate_rows(**common, seats=1, out=str(tmp_path / "agents"))
    # the second aggregator rank loads the task by reference for its weight names and shapes, and folds the uploads
    # of the seats dealt to it
    summary, virtual = simulate_rows(**common, seats=2, aggregator_ranks=2,
                                     out=str(tmp_path / "virtual"))
    assert summary["failed_rounds"] == 0 and sum(r["r1_uploads"] for r in virtual) > 0
    _same_rounds(agents, virtual, reported=3)
