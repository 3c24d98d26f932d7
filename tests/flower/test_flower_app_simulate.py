"""`fedpar simulate --flower-app examples/flower_app` with fedpar's own strategy: the app's ClientApp trains the
sampled members in the worker processes (its Context.state kept across their rounds) and the model learns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from fedpar.cli.main import main  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower_app"


def test_the_example_app_learns_under_fedpars_fedavg(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["simulate", "--flower-app", str(EXAMPLE), "--run-config", "num-server-rounds=2", "--strategy", "fedavg",
                 "--clients", "3", "--rounds", "2", "--workers", "1", "--lr", "0.5", "--quiet", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["status"], r["reported"]) for r in rows] == [("ok", 3), ("ok", 3)]
    assert rows[1]["train_loss"] < rows[0]["train_loss"]
    # members evaluate the global model they get: after one round of fedpar's FedAvg it beats chance (10 classes)
    assert rows[1]["federated_eval_accuracy"] > max(0.3, rows[0]["federated_eval_accuracy"])
    assert rows[1]["train_rounds-trained"] == 2.0  # each member's Context.state counted its own rounds
    model = json.loads((out / "global.json").read_text())["model"]  # what the final arrays belong to
    assert model == {"flower_app": str(EXAMPLE), "run_config": {"num-server-rounds": 2, "fraction-train": 1.0,
                                                                "local-epochs": 2, "lr": 0.5, "batch-size": 32}}


@pytest.mark.parametrize("features", [
    ["--secure-aggregation", "--secagg-clip", "0.5", "--aggregator-ranks", "2"],
    ["--privacy", "central", "--privacy-noise", "0.01", "--privacy-clip", "5", "--compression", "int8"],
], ids=["secagg-2-ranks", "central-dp-int8"])
def test_the_example_app_trains_under_fedpars_secure_aggregation_privacy_compression_and_ranks(features, tmp_path,
                                                                                                capsys):
    out = tmp_path / "run"
    code = main(["simulate", "--flower-app", str(EXAMPLE), "--strategy", "fedavg", "--clients", "3", "--rounds", "2",
                 "--workers", "1", "--lr", "0.5", "--quiet", "--out", str(out), *features])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["status"], r["reported"]) for r in rows] == [("ok", 3), ("ok", 3)]
    assert all(r["update_norm"] > 0 for r in rows)  # the ClientApp's training moved the global model
    if "train_loss" in rows[0]:  # (secure aggregation keeps the members' own figures from the coordinator)
        assert rows[1]["train_loss"] < rows[0]["train_loss"]
