"""A run's settings: the run-level sections of ``fedpar serve`` (task, model and data, strategy and its options,
rounds and cohort, deadline, local training, privacy, secure aggregation, compression, seed, plots), read from a TOML
file and checked with the same declarations as serve's flags."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from fedpar.cli.config import ConfigError, flag_key_dests, load_toml_section_and_file, rename_key, typed_value
from fedpar.cli.privacy import PrivacyOptions
from fedpar.datasets.settings import DataSource
from fedpar.meant import closest
from fedpar.protocol.compressed_wire import CompressionConfig
from fedpar.protocol.task_settings import LocalTraining
from fedpar.sections import Plots, Seeded
from fedpar.server.config import RoundSampling, SecureAggregation, StrategyChoice
from fedpar.settings import declared_fields, setting_key
from fedpar.task import TaskReference

RUN_SECTIONS = (DataSource, TaskReference, StrategyChoice, RoundSampling, LocalTraining, SecureAggregation,
                CompressionConfig, PrivacyOptions, Seeded, Plots)
RUN_KEYS = frozenset(setting_key(f) for cls in RUN_SECTIONS for f in declared_fields(cls))
TABLE = "run"  # a run file's settings: its [run] table, or its top level


def serve_parser() -> argparse.ArgumentParser:
    """The parser of ``fedpar serve``: a run's keys are its options, and checked as they are."""
    from fedpar.cli.main import build_parser, subcommand_parser

    return subcommand_parser(build_parser(only="serve"), "serve")


def run_settings(values: dict[str, Any], where: str) -> dict[str, Any]:
    """``values`` (TOML keys -> values) checked as serve's options; ConfigError naming ``where`` and the key for an
    unknown key or a bad value. Returns the values as serve's parser would hold them (JSON-ready)."""
    parser = serve_parser()
    actions = {a.dest: a for a in parser._actions}
    values = _flag_keys_renamed(parser, values, where)
    unknown = sorted(k for k in values if k not in RUN_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown run setting(s) {', '.join(_unknown_said(unknown, actions))}; a run sets "
                          f"only {', '.join(sorted(RUN_KEYS))}")
    out = {}
    for key, value in values.items():
        try:
            out[key] = typed_value(actions[key], value)
        except ValueError as exc:
            raise ConfigError(f"{where}: {key}: {exc}") from None
        if isinstance(out[key], Path):
            out[key] = str(out[key])
    return out


def _unknown_said(unknown: list[str], serve_actions: dict[str, argparse.Action]) -> list[str]:
    """Each ``unknown`` key with the run setting it likely misspells, or, for a setting of the service's own (its
    ports, folders, certificates), the flag that sets it when the service starts."""
    said = []
    for key in unknown:
        action = serve_actions.get(key)
        if meant := closest(key, sorted(RUN_KEYS)):
            said.append(f"{key} (did you mean {meant}?)")
        elif action is not None and action.option_strings:
            said.append(f"{key} (the service's own, set by fedpar serve {action.option_strings[0]} when it starts)")
        else:
            said.append(key)
    return said


def _flag_keys_renamed(parser: argparse.ArgumentParser, values: dict[str, Any], where: str) -> dict[str, Any]:
    """``values`` with each key a --config file may use for a run setting, as its flag is spelled (``lr`` for
    ``learning_rate``, ``deadline`` for ``deadline_seconds``), moved to the setting's own key, as --config does
    (cli/config.py); ConfigError when both names are given."""
    out = dict(values)
    names = {key: key for key in out}
    for key, dest in flag_key_dests(parser).items():
        if key in out and dest in RUN_KEYS:
            rename_key(out, names, key, dest, where)
    return out


def said_with_keys(message: str) -> str:
    """``message`` (the service's refusal of a run, whose checks are serve's and name its flags) with each run
    setting named as in a run file: ``privacy = "central"`` for ``--privacy central``, ``topk_ratio`` for
    ``--topk-ratio``, ``secure_aggregation = true`` for ``--secure-aggregation``; the service's own flags stay
    flags. The reverse of cli/declared.py's said_with_flags: each check is written once, naming flags."""
    for action in serve_parser()._actions:
        if action.dest not in RUN_KEYS:
            continue
        for flag in (s for s in action.option_strings if s.startswith("--")):
            words = "|".join(re.escape(str(c)) for c in action.choices or ())
            given = rf"(?: ({words})(?![\w-]))?" if words else ""
            message = re.sub(rf"(?<![\w/.-]){re.escape(flag)}(?![\w-]){given}",
                             lambda m, key=action.dest, on=action.nargs == 0: _key_said(key, m, on), message)
    return message


def _key_said(key: str, match: re.Match, switch: bool) -> str:
    """``key`` as a run file sets it: with the value the flag was said with (a choice's word, or true for a
    switch), else alone."""
    value = match.group(1) if match.re.groups else None
    if value is not None:
        return f"{key} = {json.dumps(value)}"
    return f"{key} = true" if switch else key


def read_run_file(path: str | Path) -> dict[str, Any]:
    """The checked settings of run file ``path`` (its [run] table or its top level); ConfigError when unusable."""
    dict_options = {setting_key(f) for cls in RUN_SECTIONS for f in declared_fields(cls) if f.default_factory is dict}
    try:  # first: a missing or invalid file is said as such
        values, doc = load_toml_section_and_file(path, TABLE, dict_options)
    except ConfigError as exc:  # its lines call the file a config file (--config's): this one is a run file
        raise ConfigError(str(exc).replace("config file ", "run file ", 1)) from None
    _check_tables(path, doc, dict_options)
    return run_settings(values, str(path))


def _check_tables(path: str | Path, doc: dict[str, Any], dict_options: set[str]) -> None:
    """ConfigError for a table run file ``path`` (read as ``doc``) may not have (e.g. [serve], whose keys would go
    unread), or for settings both at its top level and in [run]."""
    others = ", ".join(f"[{name}]" for name in sorted(dict_options))
    if isinstance(doc.get(TABLE), dict):
        beside = sorted(key for key in doc if key != TABLE)
        if beside:
            raise ConfigError(f"{path}: {', '.join(beside)} outside [{TABLE}] would be ignored; put every setting in "
                              f"[{TABLE}] (its only tables: {others})")
        doc = doc[TABLE]
    tables = sorted(key for key, value in doc.items() if isinstance(value, dict) and key not in dict_options)
    if tables:
        raise ConfigError(f"{path}: unknown table(s) {', '.join(f'[{t}]' for t in tables)}; a run file's settings sit "
                          f"at its top level or in [{TABLE}], and its only other tables are {others}")


def effective_settings(options: argparse.Namespace) -> dict[str, Any]:
    """Every run setting of ``options`` (a run's: the service's flags with its file over them), paths as text: what
    a run is fixed to when it is submitted, whatever flags the service is restarted with later."""
    values = {key: getattr(options, key) for key in sorted(RUN_KEYS) if hasattr(options, key)}
    return {key: str(value) if isinstance(value, Path) else value for key, value in values.items()}


def run_args(service: argparse.Namespace, settings: dict[str, Any]) -> argparse.Namespace:
    """The options of one run: the service's, with the run's settings over them."""
    return argparse.Namespace(**{**vars(service), **settings})
