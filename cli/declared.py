"""Command-line options generated from settings declared once in a dataclass (``fedpar.settings.setting``), and the
short sections every subcommand's ``--help`` is grouped into."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Callable

from fedpar.cli import argtypes
from fedpar.settings import (APPEND, CHECK, CHOICES, FLAG, GROUP, HELP, METAVAR, declared_fields, setting_key,
                             setting_site, word_for)

# Section key -> (title, description). A subcommand's --help shows its sections in the order it first uses them.
SECTIONS: dict[str, tuple[str, str | None]] = {
    "coordinator": ("coordinator", None),
    "connection": ("connection", None),
    "data": ("data and model", None),
    "rounds": ("rounds and sampling", None),
    "training": ("local training", "sent to the agents with each task"),
    "device": ("device", None),
    "strategy": ("aggregation", None),
    "transfer": ("transfer", "how weights and updates travel"),
    "secagg": ("secure aggregation", "SecAgg+ masking: the coordinator learns only the weighted mean"),
    "simulation": ("simulated clients", None),
    "engine": ("large-model agent", "one agent over several local ranks (dp-replicate*fsdp*tp = --nproc)"),
    "optimisation": ("optimisation", None),
    "parallel": ("parallelism", "dp-replicate*fsdp*tp*pp = world size; -1 infers one degree"),
    "privacy": ("differential privacy", "DP-FedAvg (McMahan et al. 2018, Andrew et al. 2021)"),
    "limits": ("limits", "refusals are RESOURCE_EXHAUSTED (or INVALID_ARGUMENT for malformed input) with a message "
                         "naming the option"),
    "tls": ("TLS and identity", None),
    "observability": ("observability", "metrics.jsonl and metrics.csv are always written to --out"),
    "outputs": ("outputs", None),
    "certificates": ("certificates", None),
    "revocation": ("revocation and tokens", None),
}


@dataclasses.dataclass(frozen=True)
class Needs:
    """The switch a setting applies under: the switch's dest, the values that turn the setting's feature on (or a
    test of the switch's value: ``bool`` for a switch that is on for any value it is given, a path, a share above 0),
    those values as the user gives them, and why the setting needs them (said when the switch holds another value
    than ``off``). ``unless``: settings that, when given, make the setting another check's matter (--data-dir beside
    --task is refused for --task's reason)."""

    switch: str
    on: tuple | Callable[[Any], bool]
    words: str
    why: str = ""
    off: Any = None
    unless: tuple[str, ...] = ()

    def applies(self, switch_value: Any) -> bool:
        """Whether the switch, holding ``switch_value``, turns the setting's feature on."""
        return bool(self.on(switch_value)) if callable(self.on) else switch_value in self.on

    def refusal(self, flag: str, switch_value: Any) -> str:
        """The line refusing ``flag`` set while the switch holds ``switch_value``."""
        if self.why and switch_value != self.off:
            return f"{flag} applies only with {self.words}, not {switch_value}: {self.why}; " \
                   f"use {self.words} (or drop " \
                   "the option)"
        add = "add one of them" if " or " in self.words else "add it"
        return f"{flag} applies only with {self.words}; {add} (or drop the option)"


def reads_a_folder(dataset: Any) -> bool:
    """Whether ``dataset`` (a --dataset name) is read from a folder (--data-dir); True for a name that is no dataset,
    which its loader refuses with the valid names."""
    from fedpar.datasets.registry import dataset_entry

    try:
        return bool(dataset_entry(dataset).folder)
    except (TypeError, ValueError):
        return True


def shares_ranks(aggregator_ranks: Any) -> bool:
    """Whether the coordinator runs as several aggregator ranks: --aggregator-ranks above 1, or several processes
    launched by torchrun (which then ignores --aggregator-ranks)."""
    world = os.environ.get("WORLD_SIZE", "")
    return (world.isdigit() and int(world) > 1) or (aggregator_ranks or 1) > 1


# Settings that apply only when a switch turns their feature on; a user who set one believes the feature runs. Every
# setting of a section but its switch, or one setting by field name (its Needs, or several checked in order).
_PRIVACY = Needs("privacy", ("central", "client"), "--privacy central or --privacy client")
_ADAPTIVE_CLIPPING = Needs("privacy_adaptive_quantile", bool, "--privacy-adaptive-quantile")
_SECTION_SWITCHES = {
    "secagg": Needs("secure_aggregation", (True,), "--secure-aggregation"),
    "privacy": _PRIVACY,
}
_SETTING_SWITCHES = {
    "topk_ratio": Needs("compression", ("topk",), "--compression topk"),
    "int8_block": Needs("compression", ("int8",), "--compression int8"),
    "privacy_local_noise": Needs("privacy", ("client",), "--privacy client",
                                 why="the agents add it to their own update", off="off"),
    "privacy_clip_lr": (_PRIVACY, _ADAPTIVE_CLIPPING),  # they move the clip of adaptive clipping only
    "privacy_count_noise": (_PRIVACY, _ADAPTIVE_CLIPPING),
    "trace_day_seconds": Needs("trace", bool, "--trace"),  # the day of a trace's availability
    "slow_step_delay": Needs("slow_fraction", bool, "--slow-fraction"),  # the delay of the slow share
    # a lone coordinator waits in no collective for another rank
    "aggregator_timeout_seconds": Needs("aggregator_ranks", shares_ranks, "--aggregator-ranks above 1"),
    "round_wall_seconds": Needs("clock", ("virtual", True), "--clock virtual"),  # a real clock's round: --deadline
    # (a service's --data-dir is its runs' default: each run's TOML says its own dataset)
    "data_dir": Needs("dataset", reads_a_folder, "--dataset mnist", unless=("task", "flower_app", "state"),
                      why="the other datasets are bundled, generated or read from the path their name gives"),
}


def needs_of(f: dataclasses.Field) -> tuple[Needs, ...]:
    """The switches the setting of field ``f`` applies under, in the order they are checked; none for a setting that
    always applies, or a switch."""
    needs = _SETTING_SWITCHES.get(f.name) or _SECTION_SWITCHES.get(f.metadata.get(GROUP))
    needs = needs if isinstance(needs, tuple) else (needs,) if needs is not None else ()
    return tuple(n for n in needs if n.switch != setting_key(f))


def switched_options(parser: argparse.ArgumentParser) -> list[tuple[str, str, Any, Needs]]:
    """(dest, flag, default, Needs) of each option of ``parser`` that applies only under a switch (one for each of
    its switches, in the order they are checked)."""
    return [(a.dest, a.option_strings[0], a.default, needs) for a in parser._actions
            for needs in getattr(a, "needs", None) or ()]


def switched_settings(cls: type) -> list[tuple[str, str, Any, Needs]]:
    """(dest, flag, default, Needs) of each declared setting of ``cls`` that applies only under a switch."""
    return [(setting_key(f), "--" + (f.metadata[FLAG] or setting_key(f).replace("_", "-")), f.default, needs)
            for f in declared_fields(cls) for needs in needs_of(f)]


def section(parser: argparse.ArgumentParser, key: str) -> argparse._ArgumentGroup:
    """The argument group of section ``key`` in ``parser`` (made on first use)."""
    groups = parser.__dict__.setdefault("_fedpar_sections", {})
    if key not in groups:
        title, description = SECTIONS[key]
        groups[key] = parser.add_argument_group(title, description)
    return groups[key]


def _base_type(hint: Any) -> Any:
    """``int`` for ``int`` and ``int | None`` (and so on); the hint itself otherwise."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


def add_declared(parser: argparse.ArgumentParser, cls: type, *, only: typing.Iterable[str] | None = None,
                 skip: typing.Iterable[str] = (), defaults: dict[str, Any] | None = None,
                 required: typing.Iterable[str] = (), group: str | None = None) -> dict[str, argparse.Action]:
    """Add an option for every declared field of dataclass ``cls`` (``only`` those, less ``skip``), in its section
    (or in section ``group``); returns the options added, by field name.

    ``defaults`` overrides the dataclass's defaults by field name, for a command whose defaults differ;
    ``required`` names the fields this command needs given, on its command line or in a --config file.
    Each option remembers where its setting is declared (``setting_site``): a test walks every parser with it.
    """
    hints = typing.get_type_hints(cls)
    wanted, skipped, defaults = (set(only) if only is not None else None), set(skip), defaults or {}
    needed, added = set(required), {}
    for f in declared_fields(cls):
        if f.name in skipped or (wanted is not None and f.name not in wanted):
            continue
        meta, dest = f.metadata, setting_key(f)
        kind = _base_type(hints[f.name])
        if f.name in defaults:
            default = defaults[f.name]
        elif f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()
        key = group or meta[GROUP]
        target = section(parser, key) if key else parser
        kw: dict[str, Any] = dict(dest=dest, default=default, help=meta[HELP])
        choices = meta[CHOICES]
        convert = getattr(argtypes, meta[CHECK]) if meta[CHECK] else None
        if kind is dict or typing.get_origin(kind) is dict:
            kw["action"] = argtypes.KeyValueOption  # KEY=VALUE, repeatable; a TOML table is taken whole
        elif meta[APPEND]:
            kw["action"] = "extend" if getattr(convert, "splits", False) else "append"
            item = (typing.get_args(kind) or (str,))[0]
            if convert or item in (int, float, Path):
                kw["type"] = convert or (argtypes.path if item is Path else item)
        elif kind is bool and not isinstance(choices, dict):
            kw["action"] = argtypes.Switch
        elif isinstance(choices, dict):
            kw.update(choices=tuple(choices), default=word_for(choices, default))
            if "on" in choices:  # an auto|on|off setting: the bare flag says on
                kw.update(nargs="?", const="on")
        elif choices is not None:
            kw["choices"] = tuple(choices)
        elif convert:
            kw["type"] = convert
        elif kind is Path:
            kw["type"] = argtypes.path  # not empty: Path('') is the current folder
        elif kind in (int, float):
            kw["type"] = kind
        elif kind is str and default != "":  # not empty when given (argparse converts a str default too)
            kw["type"] = argtypes.text
        if meta[METAVAR]:
            kw["metavar"] = meta[METAVAR]
        if f.name in needed:
            kw.update(required=True, default=None)
        action = target.add_argument("--" + (meta[FLAG] or dest.replace("_", "-")), **kw)
        action.setting_site = setting_site(f)
        action.needs = needs_of(f)  # checked once parsed (cli/config.py refuse_unswitched)
        flag_key = (meta[FLAG] or "").replace("-", "_")
        # A --config file may name the setting as its flag too (deadline = 30); not a KEY=VALUE flag's, which names
        # one pair where the file's table (task_options) holds them all.
        if flag_key and flag_key != dest and kw.get("action") is not argtypes.KeyValueOption:
            action.flag_key = flag_key
        if isinstance(choices, dict):
            action.choice_values = choices  # a TOML file may give the value itself (cli/config.py)
        added[f.name] = action
    unknown = needed - set(added)
    if unknown:
        raise TypeError(f"required settings {sorted(unknown)} are not options of {cls.__name__} here")
    return added


def declared_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """Field name -> value of every declared field of ``cls`` that ``args`` holds (command-line words of a
    ``choices`` dict turned into the values they stand for)."""
    out = {}
    for f in declared_fields(cls):
        dest = setting_key(f)
        if not hasattr(args, dest):
            continue
        value, choices = getattr(args, dest), f.metadata[CHOICES]
        if isinstance(choices, dict) and isinstance(value, str) and value in choices:
            value = choices[value]
        out[f.name] = value
    return out


def from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """An instance of dataclass ``cls`` from the declared options in ``args``, then ``overrides``."""
    return cls(**{**declared_values(cls, args), **overrides})


def said_with_flags(message: str, args: argparse.Namespace, *configs: type) -> str:
    """``message`` (a config's ValueError) with each setting of ``configs`` that is an option of this command
    (``args`` holds it) named as its flag (``--min-reports``) rather than as its field (``min_reports``): as the user
    gave it. Only names with an underscore, never plain words."""
    for cls in configs:
        for f in declared_fields(cls):
            dest = setting_key(f)
            if "_" in f.name and f.name in message and hasattr(args, dest):
                flag = "--" + (f.metadata[FLAG] or dest.replace("_", "-"))
                # a name on its own, not part of a path or a longer word ('examples/flower_app/...' stays)
                message = re.sub(rf"(?<![\w/.-]){f.name}(?![\w/-]|\.\w)", flag, message)
    return message
