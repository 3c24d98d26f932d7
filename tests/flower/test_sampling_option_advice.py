"""A Flower strategy's own sampling option (Message API or legacy) is refused by `fedpar simulate` and `fedpar serve`
in one line whose advice names flags that exist for the command in use (simulate has no --fraction, --min-available)."""

from __future__ import annotations

import re

import pytest

from support.in_process import run_main

pytest.importorskip("flwr")

COMMANDS = {"simulate": ["simulate", "--clients", "4", "--rounds", "1"], "serve": ["serve", "--insecure", "--rounds", "1"]}
CASES = [
    ("flower:FedAvg", "fraction_train=0.5", "--clients-per-round (serve: also --fraction)"),
    ("flower:FedAvg", "min_available_nodes=3", "--min-available (serve) / --clients (simulate)"),
    ("flower:flwr.server.strategy:FedAvg", "fraction_fit=0.5", "--clients-per-round (serve: also --fraction)"),
    ("flower:flwr.server.strategy:FedAvg", "min_available_clients=3", "--min-available (serve) / --clients (simulate)"),
]
# The flags the advice offers each command (qualified ones only to their command): each must be one of its own.
OFFERED = {"simulate": ("--clients-per-round", "--min-reports", "--clients"),
           "serve": ("--clients-per-round", "--min-reports", "--fraction", "--min-available")}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("strategy,option,advice", CASES)
def test_refusal_names_flags_of_the_command(command, strategy, option, advice, capfd, tmp_path):
    # from a folder of its own: the default --out of two cases at once was one folder, the second run refused
    run = run_main([*COMMANDS[command], "--strategy", strategy, "--strategy-option", option], capfd, cwd=tmp_path)
    assert run.returncode == 2
    assert f"leave it out and use {advice}" in run.stderr
    assert "Traceback" not in run.stderr
    helped = run_main([command, "--help"], capfd).stdout
    for flag in OFFERED[command]:
        assert re.search(rf"{flag} [A-Z_]+", helped), f"{command} has no {flag}"
