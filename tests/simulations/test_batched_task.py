"""`fedpar simulate --task ... --client-batching`: a user's own task (examples/own_task.py: its model, its loss and
its AdamW) trains stacked as it trains one member at a time; a task whose model draws dropout is refused in one
line saying why."""

from __future__ import annotations

import json

import pytest

from fedpar.cli.main import main
from support.own_task import EXAMPLE, write_table


def _simulate(out, table, *flags) -> list[dict]:
    code = main(["simulate", "--task", EXAMPLE, "--task-option", f"csv={table}", "--clients", "4", "--rounds", "3",
                 "--workers", "1", "--seed", "0", "--quiet", "--out", str(out), *flags])
    assert code == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_a_users_task_trains_stacked_as_it_trains_one_member_at_a_time(tmp_path):
    table = write_table(tmp_path / "table.csv")
    alone = _simulate(tmp_path / "alone", table)
    stacked = _simulate(tmp_path / "stacked", table, "--client-batching")
    assert all(r["status"] == "ok" and r["reported"] == 4 for r in alone + stacked)
    # Measured here: the same accuracy every round and train losses equal to about 1e-7 relative (AdamW's update
    # reads each element alone, so the stacked optimizer steps each member as its own would).
    for a, s in zip(alone, stacked):
        assert abs(s["test_accuracy"] - a["test_accuracy"]) <= 0.02  # one test row of 60 may flip
        assert s["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
    assert stacked[-1]["test_accuracy"] > stacked[0]["test_accuracy"] - 0.02 and stacked[-1]["test_accuracy"] > 0.8


DROPOUT_TASK = """
import torch
from torch import nn
from fedpar import Task
from fedpar.datasets import ArrayDataset
from fedpar.tasks import share_of

def task():
    x = torch.randn(40, 4).numpy()
    data = ArrayDataset(x, (x[:, 0] > 0).astype("int64"))
    # a convolution: auto would stack it on a GPU, were it not for the dropout
    return Task(model=lambda: nn.Sequential(nn.Unflatten(1, (1, 4)), nn.Conv1d(1, 2, 3), nn.Flatten(),
                                            nn.Dropout(0.2), nn.Linear(4, 2)),
                client_data=lambda p: share_of(data, p), loss=nn.functional.cross_entropy, name="dropped")
"""


@pytest.mark.parametrize("on", [["--client-batching"], ["--client-batching", "on"]])
def test_a_task_whose_model_draws_dropout_is_refused_in_one_line_when_batching_is_on(tmp_path, capsys, on):
    (tmp_path / "dropped.py").write_text(DROPOUT_TASK)
    code = main(["simulate", "--task", f"{tmp_path / 'dropped.py'}:task", *on, "--clients", "2",
                 "--rounds", "1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err == ("fedpar simulate: task 'dropped': client batching needs a model without batch-norm statistics or "
                   "dropout (each member's step must be a function of its weights and batch alone); 3 is a "
                   "Dropout\n")


def test_by_default_a_task_whose_model_draws_dropout_trains_one_by_one_without_a_word(tmp_path, capsys):
    (tmp_path / "dropped.py").write_text(DROPOUT_TASK)
    code = main(["simulate", "--task", f"{tmp_path / 'dropped.py'}:task", "--clients", "4", "--workers", "1",
                 "--rounds", "1", "--quiet", "--out", str(tmp_path / "out")])
    assert code == 0 and capsys.readouterr().err == ""
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["client_batching"] is False and summary["rounds"] == 1
