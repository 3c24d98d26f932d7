"""MkDocs hook: the command-line reference, one page per ``fedpar`` subcommand, generated while the site builds from
the argument parsers the CLI itself builds (``fedpar.cli.main.build_parser``), grouped as ``--help`` groups them."""

from __future__ import annotations

import argparse

from mkdocs.structure.files import File

from fedpar.cli.main import build_parser, subcommand_parser
from fedpar.cli.subcommands import SUBCOMMANDS

FOLDER = "reference/cli"


def _cell(text: str) -> str:
    """``text`` fit for one Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _usage_of(action: argparse.Action) -> str:
    """How an option is written: its flags and what it takes (choices or a metavar)."""
    flags = ", ".join(f"`{flag}`" for flag in action.option_strings) or f"`{action.dest}`"
    if action.nargs == 0:
        return flags
    if action.choices is not None:
        return f"{flags} `{{{','.join(str(c) for c in action.choices)}}}`"
    return f"{flags} `{action.metavar or action.dest.upper()}`"


def _default_of(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS, [], {}):
        return ""
    return f"`{action.default}`"


def option_groups(name: str) -> list[tuple[str, str | None, list[argparse.Action]]]:
    """Subcommand ``name``'s options as its ``--help`` groups them: (title, description, options) in help order."""
    parser = subcommand_parser(build_parser(only=name), name)
    groups = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
        if actions:
            groups.append((group.title, group.description, actions))
    return groups


def command_page(name: str) -> str:
    """The Markdown reference page of subcommand ``name``."""
    module, summary = SUBCOMMANDS[name]
    parser = subcommand_parser(build_parser(only=name), name)
    lines = [f"# fedpar {name}", "", f"{summary[0].upper()}{summary[1:]}.", ""]
    if parser.description:
        lines += ["```text", parser.description.strip(), "```", ""]
    lines += ["Generated from the command's parser, as `fedpar " + name + " --help` shows it. Every option can also be "
              f"set as a key of the `[{name}]` table of a `--config` file (the option's name with `_` for `-`).", ""]
    for title, description, actions in option_groups(name):
        lines += [f"## {title}", ""]
        if description:
            lines += [description[0].upper() + description[1:] + ".", ""]
        lines += ["| option | default | what it sets |", "|---|---|---|"]
        lines += [f"| {_cell(_usage_of(a))} | {_cell(_default_of(a))} | {_cell(a.help or '')} |" for a in actions]
        lines.append("")
    return "\n".join(lines)


def index_page() -> str:
    """The command-line reference's index: every subcommand and what it does."""
    lines = ["# Command line", "", "`fedpar COMMAND --help` prints a command's options; these pages are generated from "
             "the same parsers.", "", "| command | what it does |", "|---|---|"]
    lines += [f"| [`fedpar {name}`]({name}.md) | {_cell(summary)} |" for name, (_, summary) in SUBCOMMANDS.items()]
    return "\n".join(lines) + "\n"


def on_files(files, config):
    """Add the generated pages to the site's files."""
    files.append(File.generated(config, f"{FOLDER}/index.md", content=index_page()))
    for name in SUBCOMMANDS:
        files.append(File.generated(config, f"{FOLDER}/{name}.md", content=command_page(name)))
    return files
