"""`fedpar simulate --secure-aggregation`: every sampled client runs the client side of SecAgg+ in its host, masks
its update, and the federation learns."""

import json

import pytest

from support.in_process import run_main


def _simulate(capfd, out, *extra, clients=4):
    """`fedpar simulate` by its main in this process; the rounds' metrics."""
    result = run_main(["simulate", "--clients", str(clients), "--rounds", "2", "--workers", "1", "--quiet", "--out",
                       str(out), *extra], capfd)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_secure_simulation_learns_like_fedavg(tmp_path, capfd):
    # Exact equality with plain FedAvg is checked over gRPC in tests/server/test_secure_rounds.py;
    # here the real Agent/trainer path runs masked end to end (plain FedAvg reaches 0.92 in this setting).
    rows = _simulate(capfd, tmp_path / "secure", "--secure-aggregation")
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert all(r["secagg_survivors"] == 4 and r["secagg_error_bound"] < 1e-6 for r in rows)
    assert all(r["num_updates"] == 4 for r in rows)  # the unmasked sum counts the updates in it
    assert all(r["close_reason"] == "every agent that shared keys uploaded" for r in rows)
    assert rows[-1]["test_accuracy"] >= 0.85
    assert not any(k.startswith(("train_", "federated_")) for r in rows for k in r)  # nothing per agent in clear


@pytest.mark.timeout(300)
def test_a_host_runs_the_secure_client_side_of_more_members_than_it_has_seats(tmp_path, capfd):
    # 10 members on 2 seats: all 10 must advertise and share keys while the key stages are open, and unmask only
    # once all 10 have uploaded, while the seats train them two at a time (a seat holding a member through those
    # waits would stall the round until its deadline)
    rows = _simulate(capfd, tmp_path / "seats", "--seats", "2", "--secure-aggregation", clients=10)
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert all(r["secagg_survivors"] == 10 and r["close_reason"] == "every agent that shared keys uploaded"
               for r in rows)
    assert all(r["round_seconds"] < 20 for r in rows)  # no stage waited out its timeout
    assert rows[-1]["test_accuracy"] >= 0.8


@pytest.mark.timeout(300)
def test_a_member_that_drops_costs_the_round_only_its_update(tmp_path, capfd):
    # The key stages wait --secagg-stage-seconds for the member that dropped; that wait was counted as the others'
    # download time, budgeted again for their upload, and left them no time to train: every round failed at its
    # deadline ("no time left to train"). The members now train while the keys are exchanged. The stages' default
    # wait, 30 s, is held to a third of the deadline: it outlasted the 6-second deadline, failing every round.
    rows = _simulate(capfd, tmp_path / "drop", "--clients-per-round", "3", "--drop-probability", "0.3",
                     "--secure-aggregation", "--deadline", "6")
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert [(r["sampled"], r["reported"]) for r in rows] == [(3, 2), (3, 2)]  # one dropped in each (seeded)
    assert all(r["close_reason"] == "every agent that shared keys uploaded" for r in rows)


def test_serve_refuses_secure_aggregation_with_a_robust_strategy(tmp_path, capsys):
    from fedpar.cli.main import main

    code = main(["serve", "--port", "0", "--insecure", "--secure-aggregation", "--strategy", "krum", "--out",
                 str(tmp_path)])
    assert code == 2
    from fedpar.aggregation.compatibility import refusal, strategy_features
    line = refusal({**strategy_features("krum"), "secure_aggregation": "--secure-aggregation"})
    assert capsys.readouterr().err == f"fedpar serve: {line}\n"  # the table's line (docs/explanation/composition.md)
