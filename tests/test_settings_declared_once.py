"""Every setting declared once (issue 26): each flag of every subcommand comes from one ``setting(...)`` field of a
section dataclass, with one help text and one default wherever it appears; configs pass their shared sections to
each other instead of mapping them by hand."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from fedpar.cli.main import build_parser, main, subcommand_parser
from fedpar.cli.subcommands import SUBCOMMANDS

# Options every subcommand gets from cli/main.py itself, not settings of any command.
GENERAL = {"--help", "--config", "--debug", "--log-level"}
# Flags with two declarations on purpose: train's global batch and rate (TrainConfig, one optimizer step over all
# ranks) are other settings than an agent's local batch and rate (LocalTraining, sent with each task); an agent's
# --data-plane (whether it takes the data plane a coordinator offers) is another than serve's (whether to offer one).
TWO_SETTINGS = {"--batch-size": {"train"}, "--lr": {"train"}, "--data-plane": {"client"}}


def _options() -> list[tuple[str, str, argparse.Action]]:
    """(command, flag, action) of every visible option of every subcommand, built through the real CLI entry."""
    parser = build_parser()
    out = []
    for command in SUBCOMMANDS:
        for action in subcommand_parser(parser, command)._actions:
            if action.help == argparse.SUPPRESS:
                continue  # a renamed flag's refusal, or an old name that still works: no declaration of its own
            out.extend((command, flag, action) for flag in action.option_strings if flag.startswith("--"))
    return out


def test_every_flag_of_every_subcommand_comes_from_a_declared_setting():
    undeclared = sorted(f"{command} {flag}" for command, flag, action in _options()
                        if flag not in GENERAL and not hasattr(action, "setting_site"))
    assert undeclared == [], f"flags not declared with fedpar.settings.setting(...): {undeclared}"


def test_no_flag_is_declared_at_two_sites_or_with_two_help_texts():
    sites: dict[str, dict[str, set[str]]] = {}
    helps: dict[str, dict[str, set[str]]] = {}
    for command, flag, action in _options():
        if flag in GENERAL or command in TWO_SETTINGS.get(flag, ()):
            continue
        sites.setdefault(flag, {}).setdefault(action.setting_site, set()).add(command)
        helps.setdefault(flag, {}).setdefault(action.help, set()).add(command)
    twice = {flag: by_site for flag, by_site in sites.items() if len(by_site) > 1}
    assert twice == {}, f"flags declared at more than one site: {twice}"
    drifting = {flag: sorted(map(sorted, by_help.values())) for flag, by_help in helps.items() if len(by_help) > 1}
    assert drifting == {}, f"flags with more than one help text: {drifting}"
    assert {"--seed", "--dataset", "--model", "--out", "--device"} <= set(sites)  # shared by several commands


def test_the_exceptions_are_really_other_settings():
    """train's --batch-size/--lr, client's --data-plane: one declaration there, another one everywhere else."""
    for flag, commands in TWO_SETTINGS.items():
        sites: dict[bool, set[str]] = {}
        for command, name, action in _options():
            if name == flag:
                sites.setdefault(command in commands, set()).add(action.setting_site)
        assert len(sites[True]) == len(sites[False]) == 1 and sites[True] != sites[False], (flag, sites)


def test_simulate_workers_and_simulate_share_the_defaults_of_every_setting_they_share():
    parser = build_parser()
    simulate = {a.dest: a for a in subcommand_parser(parser, "simulate")._actions}
    workers = [a for a in subcommand_parser(parser, "simulate-workers")._actions
               if a.option_strings and a.option_strings[0] not in GENERAL and a.help != argparse.SUPPRESS]
    shared = [a for a in workers if a.dest in simulate]
    assert len(shared) >= 15
    for action in shared:
        if action.required:  # --clients: the whole population must be said, as the coordinator's --min-available
            assert action.dest == "clients"
            continue
        assert action.default == simulate[action.dest].default, action.dest


def test_every_command_lists_every_dataset_the_registry_accepts():
    from fedpar.datasets.registry import DATASETS

    helps = {command: action.help for command, flag, action in _options() if flag == "--dataset"}
    assert set(helps) == {"serve", "client", "simulate", "simulate-workers", "train"}
    for command, text in helps.items():
        assert all(name in text for name in DATASETS), (command, text)


def test_the_registry_accepts_what_the_help_lists_and_refuses_the_rest_naming_them():
    from fedpar.datasets.registry import DATASETS, load_dataset

    assert load_dataset("synthetic", clients=4).num_classes == 10  # "synthetic[:ALPHA:BETA...]": the bare name too
    with pytest.raises(ValueError) as refused:
        load_dataset("cifar")
    assert all(name in str(refused.value) for name in DATASETS)


def test_a_simulation_passes_its_sections_to_the_coordinator_as_they_are():
    from fedpar.server.config import CoordinatorConfig
    from fedpar.settings import composed, sections_of
    from fedpar.simulations.config import SimulationConfig

    shared = [s for s in sections_of(CoordinatorConfig) if s in sections_of(SimulationConfig)]
    assert {s.__name__ for s in shared} >= {"RoundSampling", "Seeded", "LocalTraining", "AggregatorRanks",
                                            "SecureAggregation", "RoundClock"}
    changed = {}
    for section in shared:  # a value other than the default for every setting the two configs share
        for f in dataclasses.fields(section):
            default = getattr(SimulationConfig(), f.name)
            changed[f.name] = (not default if isinstance(default, bool) else
                               (default or 1) * 3 if isinstance(default, (int, float)) else default)
    simulation = SimulationConfig(**changed)
    coordinator = composed(CoordinatorConfig, simulation, clients_per_round=7)
    assert coordinator.clients_per_round == 7  # what the caller fills in wins
    for name, value in changed.items():
        if name != "clients_per_round":
            assert getattr(coordinator, name) == value, name


def test_an_old_flag_name_still_works_with_one_line_naming_the_new_one(tmp_path, capsys):
    parser = build_parser(only="train")
    args = parser.parse_args(["train", "--timeout", "42"])
    assert args.dist_timeout == 42.0 and not hasattr(args, "timeout")
    assert capsys.readouterr().err.strip() == "fedpar train: note: --timeout is now --dist-timeout; the old name " \
                                              "still works"
    toml = tmp_path / "train.toml"
    toml.write_text("[train]\ntimeout = 7\n")
    from fedpar.cli.config import apply_config_defaults

    parser = build_parser(only="train")
    apply_config_defaults(subcommand_parser(parser, "train"), ["--config", str(toml)], "train")
    assert parser.parse_args(["train"]).dist_timeout == 7.0
    assert "timeout in" in capsys.readouterr().err
    toml.write_text("[train]\ntimeout = 7\ndist_timeout = 8\n")
    assert main(["train", "--config", str(toml)]) == 2
    assert "timeout and dist_timeout are the same option" in capsys.readouterr().err
