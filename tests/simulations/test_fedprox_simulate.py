"""`fedpar simulate --strategy fedprox --strategy-option mu=...`: two quick rounds on digits with that mu."""

from __future__ import annotations

import json

import pytest

from fedpar.cli.main import main


@pytest.mark.timeout(300)
def test_simulate_fedprox_with_a_strategy_option(tmp_path, capsys):
    out = tmp_path / "prox"
    code = main(["simulate", "--strategy", "fedprox", "--strategy-option", "mu=0.05", "--clients", "3",
                 "--rounds", "2", "--local-epochs", "1", "--workers", "1", "--quiet", "--out", str(out)])
    assert code == 0, capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["strategy"] == "fedprox"
    assert summary["config"]["strategy_options"] == {"proximal_mu": 0.05}
    assert summary["rounds"] == 2 and summary["failed_rounds"] == 0
    assert summary["final_test_accuracy"] > 0.5  # chance is 0.1
