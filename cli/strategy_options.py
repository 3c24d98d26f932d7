"""--strategy and the repeatable --strategy-option KEY=VALUE of `fedpar serve` and `fedpar simulate` (or a TOML
table), declared once in ``fedpar.server.config.StrategyChoice``. Their help lists the strategies, which imports
them: it is made only when help is shown."""

from __future__ import annotations

import argparse
from typing import Any

from fedpar.cli.argtypes import as_mapping
from fedpar.cli.declared import add_declared
from fedpar.server.config import StrategyChoice


def add_strategy_arguments(p: argparse.ArgumentParser, command: str) -> None:
    """Add ``--strategy`` and ``--strategy-option`` to ``p`` (``command`` names the TOML table in the help)."""
    options = add_declared(p, StrategyChoice)
    options["strategy"].help_factory = _strategy_help
    options["strategy_options"].help_factory = lambda: _options_help(command)


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


def strategy_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The typed options of ``args.strategy``; ValueError naming the valid ones when a key or value is bad."""
    from fedpar.aggregation import parse_strategy_options

    return parse_strategy_options(args.strategy, as_mapping(getattr(args, "strategy_options", None)))
