"""Nothing adjusted in silence (issue 31): a setting fedpar lowers on its own is said in one line, with what it
used instead. `fedpar simulate`'s options are parsed and settled here, in this process, as the command does."""

from __future__ import annotations

import math

import pytest

from fedpar.cli.main import build_parser
from fedpar.cli.simulate import simulation_config
from fedpar.server.config import CoordinatorConfig
from fedpar.simulations.config import SimulationConfig
from fedpar.server.deadline import round_target


def _settle(capsys, *options: str):
    """The settings `fedpar simulate OPTIONS` runs with, and the lines it printed on stderr about them."""
    capsys.readouterr()
    cfg = simulation_config(build_parser(only="simulate").parse_args(["simulate", *options]))
    return cfg, capsys.readouterr().err.splitlines()


def test_clients_per_round_above_clients_is_said_and_lowered(capsys):
    cfg, lines = _settle(capsys, "--clients", "10", "--clients-per-round", "20")
    assert lines == ["fedpar simulate: --clients-per-round 20 is above --clients 10; using 10"]
    assert cfg.clients_per_round == 10


def test_more_worker_processes_than_clients_is_said_and_lowered(capsys):
    cfg, lines = _settle(capsys, "--clients", "2", "--workers", "4")
    assert lines == ["fedpar simulate: --workers 4 is above --clients 2; using 2 (a worker process hosts at least one "
                     "client)"]
    assert cfg.workers == 2


def test_more_seats_than_clients_is_said_and_lowered(capsys):
    # --seats 10^12 hung each worker process making its seats; no round ran
    cfg, lines = _settle(capsys, "--clients", "4", "--seats", str(10**12))
    assert lines == ["fedpar simulate: --seats 1000000000000 is above --clients 4; using 4 (a seat trains one sampled "
                     "client at a time)"]
    assert cfg.seats == 4


@pytest.mark.parametrize("options, line, k", [
    (["--clients", "10", "--overselect", "1.3"],
     "--overselect 1.3 would sample 13 clients per round, more than --clients 10; sampling all 10 (--overselect 1)", 10),
    (["--clients", "10", "--clients-per-round", "3", "--overselect", "5"],
     "--overselect 5 would sample 15 clients per round, more than --clients 10; sampling all 10 (--overselect "
     "3.333)", 3),
])
def test_overselecting_more_clients_than_there_are_is_said_and_lowered(capsys, options, line, k):
    cfg, lines = _settle(capsys, *options)
    assert lines == [f"fedpar simulate: {line}"]
    assert math.ceil(k * cfg.overselect) == 10  # all of them, and not one more


def test_settings_within_reach_are_used_as_given_and_settled_ones_stay_settled(capsys):
    cfg, lines = _settle(capsys, "--clients", "10", "--clients-per-round", "5", "--overselect", "1.5", "--workers",
                         "2")
    assert lines == [] and (cfg.clients_per_round, cfg.overselect, cfg.workers) == (5, 1.5, 2)
    lowered, lines = _settle(capsys, "--clients", "3", "--clients-per-round", "7", "--workers", "5", "--overselect",
                             "2")
    assert len(lines) == 3
    assert lowered.settled() == (lowered, [])  # run_simulation settles again: nothing more to say


def test_a_round_with_fewer_agents_sampled_than_k_says_so_in_its_log_line():
    assert round_target(CoordinatorConfig(clients_per_round=10), live=2, sampled=2) == \
        (2, "--clients-per-round 10 is above the 2 agents sampled; using 2")
    assert round_target(CoordinatorConfig(clients_per_round=2), live=5, sampled=3) == (2, "")
    assert round_target(CoordinatorConfig(fraction=0.1, min_reports=3), live=10, sampled=4) == \
        (3, "--fraction 0.1 of 10 live agents is 1, below --min-reports 3; using 3")
    assert round_target(CoordinatorConfig(fraction=0.5), live=10, sampled=7) == (5, "")


def test_the_default_worker_processes_are_lowered_to_one_client_unsaid(capsys):
    cfg, lines = _settle(capsys, "--clients", "1")  # it said '--workers 2 is above --clients 1', a flag not given
    assert lines == [] and cfg.workers == 1


def test_a_refusal_names_settings_by_their_flags_and_leaves_paths_as_they_are():
    """A path holding a setting's name (the shipped examples/flower_app) was printed as examples/--flower-app."""
    import argparse

    from fedpar.cli.declared import said_with_flags

    args = argparse.Namespace(flower_app="x", min_reports=1, clients_per_round=2)
    said = said_with_flags("min_reports (10) cannot exceed clients_per_round (5); see examples/flower_app/pyproject"
                           ".toml, flower_app.py and flower_app.", args, SimulationConfig, CoordinatorConfig)
    assert said == ("--min-reports (10) cannot exceed --clients-per-round (5); see examples/flower_app/pyproject.toml, "
                    "flower_app.py and --flower-app.")


def test_a_population_above_the_default_cohort_samples_100_a_round_and_says_so(capsys):
    """--clients 100000 alone trained every client each round (6.3 GiB); a population samples a cohort."""
    cfg, lines = _settle(capsys, "--clients", "100000")
    assert lines == ["fedpar simulate: sampling 100 of the 100000 clients each round (all of them, up to 100, unless "
                     "--clients-per-round says how many)"]
    assert cfg.clients_per_round == 100 and cfg.settled() == (cfg, [])
    for options in (["--clients", "100"], ["--clients", "1000", "--clients-per-round", "1000"]):
        cfg, lines = _settle(capsys, *options)
        assert lines == [] and cfg.clients_per_round in (None, 1000)  # all of them, as asked or within the default
