"""TOML configuration files for the command line: file values become defaults, flags override.

A subcommand's table may hold nested tables, e.g. ``[train.parallel]``: their keys are options of the
subcommand like the table's own (``tp = 2`` there means ``--tp 2``), unless the subcommand has an option
named after the table, which then receives the whole table as a dict (``[train.model_kwargs]``).
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration file that cannot be used, with a message that says what to change."""


def _subcommand_names() -> set[str]:
    from fedpar.cli.main import SUBCOMMANDS  # imported late: main imports this module

    return set(SUBCOMMANDS)


def _key(name: str) -> str:
    return name.replace("-", "_")


def _flatten(table: dict[str, Any], where: str, dict_options: set[str], skip: set[str],
             out: dict[str, Any], origin: dict[str, str]) -> None:
    label = f"[{where}]" if where else "the top level"
    for raw, value in table.items():
        key = _key(raw)
        if isinstance(value, dict) and key not in dict_options:
            if raw not in skip:
                _flatten(value, f"{where}.{raw}" if where else raw, dict_options, set(), out, origin)
            continue
        if key in out:
            raise ConfigError(f"option {key} is set twice, in {origin[key]} and in {label}; keep one of them")
        out[key], origin[key] = value, label


def load_toml_section(path: str | Path, section: str, dict_options: set[str] | frozenset[str] = frozenset()
                      ) -> dict[str, Any]:
    """Read ``path`` and return the options of ``section`` (its table, or the top level when there is none).

    Nested tables are flattened into the options (an option in ``dict_options`` takes its table as a dict);
    at the top level, tables named after other subcommands are left to those subcommands.
    """
    path = Path(path)
    try:
        with path.open("rb") as fh:
            doc = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    own = section in doc
    table = doc[section] if own else doc
    if not isinstance(table, dict):
        raise ConfigError(f"[{section}] in {path} must be a table")
    values: dict[str, Any] = {}
    try:
        _flatten(table, section if own else "", set(dict_options), set() if own else _subcommand_names(),
                 values, {})
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return values


def apply_config_defaults(parser: argparse.ArgumentParser, argv: list[str], section: str) -> None:
    """If ``--config FILE`` is among ``argv``, make the file's values the parser's defaults."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return
    # Options without a flag (set with parser.set_defaults) can be set from the file too.
    dests = {a.dest for a in parser._actions} | {k for k in parser._defaults if not k.startswith("_")}
    dict_options = {k for k in dests if isinstance(parser.get_default(k), dict)}
    values = load_toml_section(known.config, section, dict_options)
    unknown = sorted(set(values) - dests)
    if unknown:
        raise ConfigError(
            f"{known.config}: unknown option(s) for '{section}': {', '.join(unknown)}; "
            f"run 'fedpar {section} --help' for the valid ones"
        )
    parser.set_defaults(**values)
