"""TOML configuration files for the command line: file values become defaults, flags override."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration file that cannot be used, with a message that says what to change."""


def load_toml_section(path: str | Path, section: str) -> dict[str, Any]:
    """Read ``path`` and return the table for ``section`` (or the top level when there is none)."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            doc = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    table = doc.get(section, doc)
    if not isinstance(table, dict):
        raise ConfigError(f"[{section}] in {path} must be a table")
    # Nested tables of other subcommands are not options of this one.
    return {k.replace("-", "_"): v for k, v in table.items() if not isinstance(v, dict)}


def apply_config_defaults(parser: argparse.ArgumentParser, argv: list[str], section: str) -> None:
    """If ``--config FILE`` is among ``argv``, make the file's values the parser's defaults."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return
    values = load_toml_section(known.config, section)
    dests = {a.dest for a in parser._actions}
    unknown = sorted(set(values) - dests)
    if unknown:
        raise ConfigError(
            f"{known.config}: unknown option(s) for '{section}': {', '.join(unknown)}; "
            f"run 'fedpar {section} --help' for the valid ones"
        )
    parser.set_defaults(**values)
