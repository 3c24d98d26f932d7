"""`fedpar simulate --client-batching`: real agents and a real coordinator, each worker's clients trained as one
batched model; the federation learns what the sequential one learns."""

from __future__ import annotations

import json

import pytest

from fedpar.cli.main import main

SMALL = ["--dataset", "digits", "--model", "mlp", "--seed", "0", "--quiet", "--no-plot"]


def _simulate(out, *flags) -> list[dict]:
    code = main(["simulate", *SMALL, "--out", str(out), *flags])
    assert code == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_batched_and_sequential_federations_reach_the_same_accuracy(tmp_path):
    flags = ["--clients", "6", "--rounds", "3", "--workers", "2"]
    sequential = _simulate(tmp_path / "sequential", *flags)
    batched = _simulate(tmp_path / "batched", *flags, "--client-batching")
    assert all(r["status"] == "ok" and r["reported"] == 6 for r in sequential + batched)
    # Each client's batched update equals its LocalTrainer update to float32 rounding (tests/client/
    # test_batched_trainer.py); measured here: the same accuracy every round (0.919 after round 3).
    for s, b in zip(sequential, batched):
        assert abs(s["test_accuracy"] - b["test_accuracy"]) <= 0.003, (s, b)
        assert b["train_loss"] == pytest.approx(s["train_loss"], rel=1e-4)
    assert batched[-1]["test_accuracy"] >= 0.85


@pytest.mark.timeout(300)
def test_batched_clients_still_mask_their_updates_for_secure_aggregation(tmp_path):
    # All four agents live in one worker: they train in one batch, then run SecAgg+ on their own updates.
    rows = _simulate(tmp_path / "secure", "--clients", "4", "--rounds", "2", "--workers", "1",
                     "--secure-aggregation", "--client-batching")
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert all(r["secagg_survivors"] == 4 and r["secagg_error_bound"] < 1e-6 for r in rows)
    assert rows[-1]["test_accuracy"] >= 0.85  # as without batching (tests/simulations/test_secure_simulate.py)


@pytest.mark.timeout(300)
def test_a_convolutional_model_trains_one_by_one_on_the_cpu_by_default_and_the_summary_says_so(tmp_path):
    # stacked, the CNN was measured slower on the CPU at every size (batching_pays)
    rows = _simulate(tmp_path, "--model", "cnn", "--clients", "4", "--rounds", "1", "--workers", "1",
                     "--local-epochs", "1", "--device", "cpu")
    assert rows[0]["status"] == "ok"
    assert json.loads((tmp_path / "summary.json").read_text())["client_batching"] is False


@pytest.mark.parametrize("flags, message", [
    (["--client-batching", "--precision", "bf16"], "--client-batching trains in fp32"),
    (["--client-batching", "on", "--precision", "bf16"], "--client-batching trains in fp32"),
])
def test_impossible_batching_settings_are_one_line_errors_that_keep_an_earlier_runs_outputs(tmp_path, capsys, flags,
                                                                                            message):
    # a refused command leaves the earlier run's --out as it was (QA: bf16 was refused once its files were removed)
    earlier = {name: f"{name} of an earlier run\n" for name in ("metrics.jsonl", "global.json", "summary.json")}
    for name, text in earlier.items():
        (tmp_path / name).write_text(text)
    assert main(["simulate", *SMALL, "--out", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert {p.name: p.read_text() for p in tmp_path.iterdir() if not p.name.startswith(".")} == earlier


@pytest.mark.timeout(300)
def test_a_hosts_seats_train_its_sampled_members_in_batches_and_the_model_learns():
    import torch

    from fedpar.simulations.population import host_population
    from support.population_host import digits_population

    # 12 of 24 members a round on 8 seats: two waves of members per round, each wave one batched model
    torch.set_num_threads(1)
    clients, per_round, rounds = 24, 12, 3
    rows: list[dict] = []
    with digits_population(clients, rows, rounds=rounds, clients_per_round=per_round, overselect=1.0,
                           local_epochs=3) as (worker, task):
        host = host_population(worker.server, worker.population, task, worker.partition_of, 0, seats=8,
                               poll_seconds=1.0, client_batching=True)
        host.run()  # until the coordinator says training is over
    assert [(r["status"], r["reported"]) for r in rows] == [("ok", per_round)] * rounds
    assert rows[-1]["test_accuracy"] > max(0.5, rows[0]["test_accuracy"])  # the model learns
    batches = list(host.seats[0].trainer.batcher.batch_sizes)  # one batcher for the host's seats
    # the runtime says how many tasks it queued: a stack starts once every seat is in it, or no task is left
    assert batches == [8, 4] * rounds, batches

