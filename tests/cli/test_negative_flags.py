"""True/false settings are declared positively, so their generated flags read as one negation at most: serve's
--central-eval / --no-central-eval and client's --data-plane / --no-data-plane (they were --no-no-central-eval and
--no-no-data-plane); the flag users type, --no-central-eval or --no-data-plane, keeps its meaning, and a --config
file's old key (no_central_eval = true) is read as the new one with the opposite value, with one note line."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from fedpar.cli.config import apply_config_defaults
from fedpar.cli.main import build_parser, main, subcommand_parser
from fedpar.cli.subcommands import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[2]
AGENT = ["--agent-id", "a", "--insecure"]


def _option_strings(parser: argparse.ArgumentParser, where: str):
    """(command, option string) of every option of ``parser`` and of the parsers of its own subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _option_strings(sub, f"{where} {name}")
        yield from ((where, flag) for flag in action.option_strings)


def test_no_subcommand_has_a_double_negative_flag():
    parser = build_parser()
    doubled = [f"{where} {flag}" for command in SUBCOMMANDS
               for where, flag in _option_strings(subcommand_parser(parser, command), f"fedpar {command}")
               if flag.startswith("--no-no-")]
    assert doubled == []


def _parsed(command: str, argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed as fedpar.cli.main does it: the --config file's values first, then the flags."""
    parser = build_parser(only=command)
    apply_config_defaults(subcommand_parser(parser, command), argv, command)
    return parser.parse_args([command, *argv])


@pytest.mark.parametrize("command, dest, flag, extra", [("serve", "central_eval", "central-eval", []),
                                                        ("client", "data_plane", "data-plane", AGENT)])
def test_the_flag_users_type_keeps_its_meaning(command, dest, flag, extra):
    assert getattr(_parsed(command, extra), dest) is True
    assert getattr(_parsed(command, [*extra, f"--no-{flag}"]), dest) is False
    assert getattr(_parsed(command, [*extra, f"--{flag}"]), dest) is True


@pytest.mark.parametrize("command, old, new, extra", [("serve", "no_central_eval", "central_eval", []),
                                                      ("client", "no_data_plane", "data_plane", AGENT)])
@pytest.mark.parametrize("value", [True, False])
def test_a_config_files_old_key_is_read_with_its_meaning_and_one_note(command, old, new, extra, value, tmp_path,
                                                                       capsys):
    config = tmp_path / "old.toml"
    config.write_text(f"[{command}]\n{old} = {str(value).lower()}\n")
    assert getattr(_parsed(command, [*extra, "--config", str(config)]), new) is (not value)
    assert capsys.readouterr().err.splitlines() == [
        f"fedpar {command}: note: {old} = {str(value).lower()} in {config} is now {new} = {str(not value).lower()}; "
        "the old name still works"]
    flag = "--" + new.replace("_", "-")  # the command line still overrides the file
    assert getattr(_parsed(command, [*extra, "--config", str(config), flag]), new) is True


@pytest.mark.parametrize("toml, line", [
    ("no_central_eval = 1\n", "{config}: no_central_eval: expected true or false, got 1"),
    ("no_central_eval = true\ncentral_eval = false\n",
     "{config}: no_central_eval and central_eval are the same option; keep central_eval"),
])
def test_a_config_files_old_key_that_cannot_be_read_is_one_line(toml, line, tmp_path, capsys):
    config = tmp_path / "old.toml"
    config.write_text(f"[serve]\n{toml}")
    assert main(["serve", "--insecure", "--port", "0", "--config", str(config)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"fedpar serve: {line.format(config=config)}"]


@pytest.mark.parametrize("command, old, meant", [(["serve", "--insecure", "--port", "0"], "--no-no-central-eval",
                                                  "--central-eval"),
                                                 (["client", *AGENT], "--no-no-data-plane", "--data-plane")])
def test_the_old_double_negative_flag_is_refused_naming_the_flag_of_its_meaning(command, old, meant):
    """It meant on: the closest spelling, --no-central-eval, means off."""
    done = subprocess.run([sys.executable, "-m", "fedpar", *command, old], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert (done.returncode, done.stderr.splitlines()) == (2, [
        f"fedpar {command[0]}: error: unrecognized arguments: {old} (did you mean {meant}?); see "
        f"'fedpar {command[0]} --help'"])
