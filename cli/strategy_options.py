"""--strategy and the repeatable --strategy-option KEY=VALUE of `fedpar serve` and `fedpar simulate` (or a TOML
table). Their help lists the strategies, which imports them: it is made only when help is shown."""

from __future__ import annotations

import argparse
from typing import Any

from fedpar.cli.declared import section


class KeyValueOption(argparse.Action):
    """Collect ``KEY=VALUE`` into a dict on top of the config file's table; a later flag overrides a key."""

    def __call__(self, parser, namespace, value, option_string=None):
        """Add one ``KEY=VALUE``."""
        key, sep, text = value.partition("=")
        if not sep or not key.strip():
            parser.error(f"{option_string} expects KEY=VALUE, got {value!r}")
        try:
            options = as_mapping(getattr(namespace, self.dest, None), self.dest)
        except ValueError as exc:
            parser.error(str(exc))
        options[key.strip()] = text.strip()
        setattr(namespace, self.dest, options)


def add_strategy_arguments(p: argparse.ArgumentParser, command: str) -> None:
    """Add ``--strategy`` and ``--strategy-option`` to ``p`` (``command`` names the TOML table in the help)."""
    g = section(p, "strategy")
    g.add_argument("--strategy", default="fedavg", help="aggregation strategy").help_factory = _strategy_help
    g.add_argument("--strategy-option", dest="strategy_options", action=KeyValueOption, metavar="KEY=VALUE",
                   default={},  # a dict default: a TOML [COMMAND.strategy_options] table is taken whole
                   help="set an option of --strategy (repeatable)").help_factory = lambda: _options_help(command)


def _strategy_help() -> str:
    from fedpar.aggregation import strategy_names

    return (f"aggregation strategy ({', '.join(strategy_names())}), or flower:package.module:Class (or "
            "flower:file.py:Class) for a Flower strategy's aggregate_fit (pip install 'fedpar[flower]'; it holds "
            "every update of a round)")


def _options_help(command: str) -> str:
    from fedpar.aggregation import strategy_options_help

    return ("set an option of --strategy (repeatable), checked against its constructor: "
            f"{strategy_options_help()}. Short names (in parentheses) also work, e.g. "
            f"--strategy fedprox --strategy-option mu=0.01. In a --config file: a "
            f"[{command}.strategy_options] table, e.g. mu = 0.01")


def as_mapping(value: Any, name: str = "strategy_options") -> dict[str, Any]:
    """The options (``name`` in a config file) as a dict, from a flag-built dict, a TOML table, or a TOML list of
    ``"KEY=VALUE"`` strings."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list) and all(isinstance(v, str) and "=" in v for v in value):
        return {k.strip(): v.strip() for k, _, v in (item.partition("=") for item in value)}
    raise ValueError(f"{name} must be a table or a list of \"KEY=VALUE\" strings, got {value!r}")


def strategy_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The typed options of ``args.strategy``; ValueError naming the valid ones when a key or value is bad."""
    from fedpar.aggregation import parse_strategy_options

    return parse_strategy_options(args.strategy, as_mapping(getattr(args, "strategy_options", None)))
